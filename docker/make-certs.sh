#!/bin/sh
# Writes TLS certificates for a test cluster into the secrets folder (docker/make-secrets.sh's): a private CA and
# one server certificate for the coordinator's gRPC, its dashboard and the weight server, signed by it.
#
#   docker/make-certs.sh secrets [NAME_OR_IP ...]     e.g. docker/make-certs.sh secrets 10.0.0.5 head.example
#
# dlc_tls_ca     the CA's certificate: every client trusts it (coordinator.tls_ca; dlcctl --tls-ca)
# dlc_tls_cert   the server's certificate, valid for coordinator, weights, localhost, 127.0.0.1 and each
#                NAME_OR_IP given (the head's address as the worker nodes dial it)
# dlc_tls_key    the server's private key
# The CA's own key (tls-ca-key.pem) stays in the folder, which is mode 700, and is never mounted into a container;
# the files are mode 444 for the reason make-secrets.sh gives. A certificate that exists is kept: to renew, or to
# add a name, delete dlc_tls_cert (and dlc_tls_key) and run this again; delete the folder's tls-ca* files too for a
# new CA (then every node needs the new dlc_tls_ca). For production, use your own CA's certificates under
# these three names. Needs openssl.
set -eu
dir="${1:?usage: docker/make-certs.sh FOLDER [NAME_OR_IP ...]}"
shift
command -v openssl >/dev/null || { echo "make-certs.sh: needs openssl" >&2; exit 2; }
umask 077
mkdir -p "$dir"
chmod 700 "$dir"
days="${DLC_CERT_DAYS:-825}"
if [ ! -s "$dir/tls-ca-key.pem" ] || [ ! -s "$dir/dlc_tls_ca" ]; then
    openssl req -x509 -newkey rsa:3072 -nodes -days "$days" -subj "/CN=dlc-rl test cluster CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -keyout "$dir/tls-ca-key.pem" -out "$dir/dlc_tls_ca" 2>/dev/null
    rm -f "$dir/dlc_tls_cert" "$dir/dlc_tls_key"  # a new CA: the old server certificate is not signed by it
    echo "written $dir/dlc_tls_ca (and its key, tls-ca-key.pem)"
else
    echo "kept    $dir/dlc_tls_ca"
fi
if [ ! -s "$dir/dlc_tls_cert" ] || [ ! -s "$dir/dlc_tls_key" ]; then
    names="DNS:coordinator,DNS:weights,DNS:localhost,IP:127.0.0.1"
    for name in "$@"; do
        case "$name" in
            *[!0-9.]*) case "$name" in *:*) names="$names,IP:$name" ;; *) names="$names,DNS:$name" ;; esac ;;
            *) names="$names,IP:$name" ;;
        esac
    done
    ext="$dir/.server.ext"
    printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' "$names" > "$ext"
    openssl req -newkey rsa:3072 -nodes -subj "/CN=coordinator" -keyout "$dir/dlc_tls_key" \
        -out "$dir/.server.csr" 2>/dev/null
    openssl x509 -req -in "$dir/.server.csr" -CA "$dir/dlc_tls_ca" -CAkey "$dir/tls-ca-key.pem" \
        -CAcreateserial -CAserial "$dir/.tls-ca.srl" -days "$days" -extfile "$ext" -out "$dir/dlc_tls_cert" 2>/dev/null
    rm -f "$ext" "$dir/.server.csr"
    echo "written $dir/dlc_tls_cert ($names) and $dir/dlc_tls_key"
else
    echo "kept    $dir/dlc_tls_cert"
fi
chmod 444 "$dir/dlc_tls_ca" "$dir/dlc_tls_cert" "$dir/dlc_tls_key"
chmod 400 "$dir/tls-ca-key.pem"

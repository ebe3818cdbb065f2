#!/bin/sh
# The redis service's entrypoint under Docker Swarm (docker-stack.yml): its ACL users come from swarm secrets,
# never from a command line or an environment variable.
#
# Each DLC_REDIS_USER_<NAME> variable holds one user's rules (rlcommon/redis_acl.py: keys and commands, not
# secret); the user's password is the file $DLC_REDIS_SECRETS/redis_<name>_password (default /run/secrets). A
# user whose rules turn it `on` must have that file. The ACL file written ($DLC_REDIS_ACL_FILE, default
# /tmp/dlc-users.acl, mode 600) holds each password's sha256, not the password. Then it runs the command it
# was given with `--aclfile` added: `dlc-redis-acl redis-server --appendonly yes ...`.
set -eu
secrets="${DLC_REDIS_SECRETS:-/run/secrets}"
acl="${DLC_REDIS_ACL_FILE:-/tmp/dlc-users.acl}"
umask 077
: > "$acl"
names=$(env | sed -n 's/^DLC_REDIS_USER_\([A-Za-z0-9_]*\)=.*/\1/p' | sort)
[ -n "$names" ] || { echo "dlc-redis-acl: no DLC_REDIS_USER_<NAME> variable: no user to define" >&2; exit 2; }
for name in $names; do
    user=$(printf %s "$name" | tr 'A-Z' 'a-z')
    eval "rules=\$DLC_REDIS_USER_$name"
    line="user $user $rules"
    secret="$secrets/redis_${user}_password"
    if [ -r "$secret" ]; then
        password=$(cat "$secret")
        [ -n "$password" ] || { echo "dlc-redis-acl: $secret is empty" >&2; exit 2; }
        line="$line #$(printf %s "$password" | sha256sum | cut -d' ' -f1)"
    elif [ "${rules%% *}" = "on" ]; then
        echo "dlc-redis-acl: user $user is on but $secret cannot be read (a swarm secret of the service?)" >&2
        exit 2
    fi
    printf '%s\n' "$line" >> "$acl"
done
echo "dlc-redis-acl: $(echo $names | wc -w) users written to $acl"
exec "$@" --aclfile "$acl"

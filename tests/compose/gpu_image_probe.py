"""Runs inside the GPU image (dlc-rl/gpu), on a machine without a GPU: what the image can be checked for before a
GPU node ever sees it. Prints one JSON object; tests/compose/test_gpu_image.py asserts on it.

    docker run --rm -v tests/compose:/probe:ro -v configs:/configs:ro dlc-rl/gpu python /probe/gpu_image_probe.py CASES

CASES: a JSON file of {"configs": {name: environment}, "placements": {name: {"environ": ..., "dev_nodes": n,
"samplers": k}}}. Each part is caught on its own, so one failure shows beside the others' answers.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path


def versions() -> dict:
    import torch
    import vllm

    from rlcommon.versions import TORCH_VERSION, VLLM_VERSION

    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "vllm": vllm.__version__, "pinned_vllm": VLLM_VERSION, "pinned_torch": TORCH_VERSION}


def vllm_hooks() -> dict:
    """The sampler's additions load and register the way vLLM's GPU worker loads them, and the vLLM API the
    sampler calls exists with the arguments it passes."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.worker.gpu_worker import Worker

    from rlcommon.config import SamplerConfig, SamplingConfig
    from sampler_svc.engine import engine_arguments
    from sampler_svc.vllm_names import TRANSFER_BACKEND, WORKER_EXTENSION
    from sampler_svc.vllm_transfer import VersionFolderEngine

    extension = resolve_obj_by_qualname(WORKER_EXTENSION)  # what vLLM's worker does with worker_extension_cls
    # vLLM refuses an extension whose attributes the worker class already has (worker_base.py): same check.
    clashes = [a for a in dir(extension) if not a.startswith("__") and hasattr(Worker, a)]
    engine_cls = WeightTransferEngineFactory._registry[TRANSFER_BACKEND]()
    kwargs, env = engine_arguments(Path("/nonexistent/model"), SamplerConfig(dtype="bfloat16"), SamplingConfig(),
                                   on_cpu=False, max_sequences=64)
    args = AsyncEngineArgs(**kwargs)  # a renamed or removed engine argument fails here
    pause = inspect.signature(AsyncLLM.pause_generation).parameters
    return {
        "extension": f"{extension.__module__}.{extension.__qualname__}",
        "worker": f"{Worker.__module__}.{Worker.__qualname__}",
        "clashes": clashes,
        "transfer_engine": f"{engine_cls.__module__}.{engine_cls.__qualname__}",
        "transfer_engine_is_ours": engine_cls is VersionFolderEngine,
        "engine_args": {"enforce_eager": args.enforce_eager, "executor": args.distributed_executor_backend,
                        "worker_extension_cls": args.worker_extension_cls, "env": env},
        "async_llm": {name: hasattr(AsyncLLM, name) for name in
                      ("pause_generation", "resume_generation", "update_weight_version", "generate", "abort",
                       "start_weight_update", "update_weights", "finish_weight_update")},
        "pause_modes": "mode" in pause and "clear_cache" in pause,
        "update_request": WeightTransferUpdateRequest(update_info={"path": "/x"}).update_info == {"path": "/x"},
    }


def configs(cases: dict[str, dict[str, str]]) -> dict:
    """Each service's configuration as a compose file gives it (its environment), loaded as the service does."""
    from rlcommon.config import ConfigError
    from rlcommon.entrypoint import config_from_args

    out, saved = {}, dict(os.environ)
    for name, environ in cases.items():
        os.environ.clear()
        os.environ.update({k: v for k, v in saved.items() if not k.startswith("DLC_")})
        os.environ.update(environ)
        try:
            cfg = config_from_args(["--config", "/configs/default.toml"])
            out[name] = {"ok": True, "trainer_device": cfg.trainer.device, "lock_dir": cfg.placement.lock_dir,
                         "sampler_dtype": cfg.sampler.dtype, "weight_transfer": cfg.sampler.weight_transfer,
                         "model": cfg.model.name_or_path}
        except ConfigError as err:
            out[name] = {"ok": False, "error": str(err)}
    os.environ.clear()
    os.environ.update(saved)
    return out


def placements(cases: dict[str, dict]) -> dict:
    """Where the trainer and `samplers` replicas land for a device list, as rlcommon.gpu_placement.place decides
    inside a container (`dev_nodes`: /dev/nvidia<N> nodes of a fake /dev)."""
    from rlcommon.config import PlacementConfig
    from rlcommon.gpu_placement import PlacementError, place

    out = {}
    for name, case in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            dev = Path(tmp, "dev")
            dev.mkdir()
            for i in range(case.get("dev_nodes", 0)):
                (dev / f"nvidia{i}").touch()
            placement = PlacementConfig(lock_dir=str(Path(tmp, "locks")), **case.get("placement", {}))
            result, claims = {"samplers": []}, []
            try:
                environ = dict(case["environ"])
                placed = place("trainer", placement, environ, dev)
                result["trainer"] = environ["CUDA_VISIBLE_DEVICES"]
                result["mode"], result["trainer_memory"] = placed.mode, placed.memory.trainer
                for _ in range(case.get("samplers", 1)):
                    environ = dict(case["environ"])
                    placed = place("sampler", placement, environ, dev)
                    claims.append(placed.claim)
                    result["samplers"].append(environ["CUDA_VISIBLE_DEVICES"])
                    result["sampler_memory"] = placed.memory.sampler
                    result["order"] = environ.get("CUDA_DEVICE_ORDER")
            except PlacementError as err:
                result["error"] = str(err)
            finally:
                for claim in claims:
                    if claim is not None:
                        claim.release()
            out[name] = result
    return out


def main(argv: list[str]) -> int:
    cases = json.loads(Path(argv[0]).read_text()) if argv else {}
    report: dict = {}
    for part, fn, arg in (("versions", versions, None), ("vllm_hooks", vllm_hooks, None),
                          ("configs", configs, cases.get("configs", {})),
                          ("placements", placements, cases.get("placements", {}))):
        try:
            report[part] = fn() if arg is None else fn(arg)
        except Exception:  # noqa: BLE001 - reported, and the test fails on it
            report[part] = {"exception": traceback.format_exc()}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

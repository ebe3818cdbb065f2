"""How new weights reach the sampler's engine.

- Path (any node, `sampler.weight_transfer = "path"`): `load_version` checks a published version folder
  (`rlcommon.weight_store` format: `<publish_dir>/v{version:06d}/` with model.safetensors, config.json,
  tokenizer files and manifest.json) before the engine touches it: the sha256 of every file, the manifest,
  no stray weight file, the same architecture as the served model. A bad or partial folder raises
  `WeightsError`; `SamplerEngine.reload_weights` then keeps serving its current version.
- NCCL (GPU, `sampler.weight_transfer = "nccl"`): `NcclWeightReceiver` drives vLLM's native weight
  transfer API (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
  `finish_weight_update`) on the receiving side; the trainer broadcasts with vLLM's
  `NCCLTrainerWeightTransferEngine`. Written against vLLM 0.32's API; it needs CUDA and cannot run on CPU.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcommon.weight_store import PublishedVersion, WeightsError, manifest_sha256, verify_version_folder

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from sampler_svc.engine import SamplerEngine

__all__ = ["ARCHITECTURE_KEYS", "NcclWeightReceiver", "WeightsError", "check_compatible", "load_version"]

logger = logging.getLogger(__name__)

ARCHITECTURE_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
"""config.json keys that must be equal for a version to be loaded in place into the served model."""


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path}: unreadable config ({err})") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: config is not a JSON object")
    return data


def check_compatible(version_dir: str | os.PathLike[str], serving_model_dir: str | os.PathLike[str]) -> None:
    """Raise WeightsError unless the version's config.json has the served model's architecture."""
    new = _read_config(Path(version_dir) / "config.json")
    served = _read_config(Path(serving_model_dir) / "config.json")
    diffs = [
        f"{key}: {served.get(key)!r} -> {new.get(key)!r}"
        for key in ARCHITECTURE_KEYS
        if new.get(key) != served.get(key)
    ]
    if diffs:
        raise WeightsError(
            f"{version_dir}: architecture differs from the served model {serving_model_dir} "
            f"({'; '.join(diffs)}); weights can only be reloaded into the same architecture"
        )


def load_version(
    version_dir: str | os.PathLike[str],
    *,
    expected_version: int | None = None,
    expected_sha256: str | None = None,
    serving_model_dir: str | os.PathLike[str] | None = None,
) -> PublishedVersion:
    """Verify a published version folder and describe it; raises WeightsError on any problem.

    Checks, in order: sha256 of every file against manifest.json (and of the manifest against
    `expected_sha256`, the WeightUpdate's), the version against `expected_version`, no `.safetensors`
    file outside the manifest (vLLM would load it too), and the architecture against
    `serving_model_dir`'s config.json. Reads every file: call it off the event loop.
    """
    folder = Path(version_dir).resolve()
    manifest = verify_version_folder(folder, expected_sha256=expected_sha256)
    weight_version = manifest["weight_version"]
    if expected_version is not None and weight_version != expected_version:
        raise WeightsError(f"{folder}: holds weight version {weight_version}, expected {expected_version}")
    stray = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in manifest["files"])
    if stray:
        raise WeightsError(f"{folder}: weight files not in the manifest: {', '.join(stray)}")
    if serving_model_dir is not None:
        check_compatible(folder, serving_model_dir)
    return PublishedVersion(
        weight_version=weight_version, step=manifest["step"], path=str(folder), sha256=manifest_sha256(folder)
    )


class NcclWeightReceiver:
    """Receiving side of vLLM's NCCL weight transfer (GPU only; `sampler.weight_transfer = "nccl"`).

    Protocol with the trainer (rank 0 of a group of 1 + the engine's workers):
    1. once: the trainer opens its endpoint with `NCCLTrainerWeightTransferEngine.trainer_init(
       NCCLTrainerInitInfo(master_address, master_port, world_size), ...)` while this sampler calls
       `connect(master_address=..., master_port=..., world_size=..., rank_offset=1)` (both block in the
       rendezvous, so they run concurrently, relayed by the coordinator);
    2. per version: the trainer announces the parameter metadata (names, dtype names, shapes) and
       broadcasts; this sampler calls `receive(weight_version=..., names=..., dtype_names=..., shapes=...)`,
       which waits for in-flight requests, then runs start_weight_update / update_weights (the NCCL
       receive, concurrent with the trainer's broadcast) / finish_weight_update.
    The engine must have been started with `sampler.weight_transfer = "nccl"` (it then passes
    `weight_transfer_config=WeightTransferConfig(backend="nccl")` to vLLM).
    """

    def __init__(self, engine: SamplerEngine) -> None:
        if engine.sampler_cfg.weight_transfer != "nccl":
            raise ValueError(
                "NcclWeightReceiver needs sampler.weight_transfer = 'nccl' "
                f"(got {engine.sampler_cfg.weight_transfer!r}): vLLM must be started with the NCCL backend"
            )
        self.engine = engine
        self.connected = False

    async def connect(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int = 1,
        packed: bool = True,
    ) -> None:
        """Join the trainer's NCCL group (blocks until the trainer joins too)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if world_size < 2 or not 1 <= rank_offset < world_size:
            raise ValueError(
                f"need world_size >= 2 and 1 <= rank_offset < world_size, got {world_size}, {rank_offset}"
            )
        init_info = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "packed": packed,
        }
        await self.engine.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        self.connected = True
        logger.info(
            "joined the NCCL weight-transfer group at %s:%d (world %d)",
            master_address,
            master_port,
            world_size,
        )

    async def receive(
        self,
        *,
        weight_version: int,
        names: list[str],
        dtype_names: list[str],
        shapes: list[list[int]],
    ) -> None:
        """Receive one full weight version broadcast by the trainer and serve it as `weight_version`."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if not self.connected:
            raise WeightsError("NCCL weight transfer is not connected: call connect() first")
        if not (len(names) == len(dtype_names) == len(shapes)) or not names:
            raise ValueError(
                f"names, dtype_names and shapes must be non-empty and of equal length "
                f"(got {len(names)}, {len(dtype_names)}, {len(shapes)})"
            )
        update = WeightTransferUpdateRequest(
            update_info={
                "names": list(names),
                "dtype_names": list(dtype_names),
                "shapes": [list(s) for s in shapes],
            }
        )

        async def load(llm: AsyncLLM) -> None:
            await llm.start_weight_update()
            await llm.update_weights(update)
            await llm.finish_weight_update()

        await self.engine.swap_weights(weight_version=weight_version, load=load)

    async def close(self) -> None:
        """Leave the NCCL group (the engine keeps serving)."""
        if self.connected:
            await self.engine.llm.shutdown_weight_transfer_engine()
            self.connected = False

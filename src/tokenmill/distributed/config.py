"""How one engine is spread over processes: tensor / pipeline parallel sizes, the backend.

Validated twice: the sizes themselves when ``EngineConfig`` is built, and against the
checkpoint's shapes (``check_shapes``) before any worker starts or any weight is read.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenmill.models.config import ArchConfig

EXECUTOR_BACKENDS = ("mp", "ray")
"""``distributed_executor_backend`` values: worker processes of this machine, or Ray actors."""
ROUTING = ("cache_aware", "round_robin")
"""``data_parallel_routing`` values (``routing.POLICIES``)."""
RAY_EXTRA = "pip install 'tokenmill[ray]'"


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks that split every layer's heads, MLP columns and vocabulary."""
    pipeline_parallel_size: int = 1
    """Stages that split the layers (the last one, with the sampler, is the driver); with
    tensor_parallel_size too, each stage is a group of that many ranks (``grid.py``)."""
    distributed_executor_backend: str = "mp"
    """How tensor / pipeline ranks 1.. run: mp (spawned processes of this machine) or ray
    (Ray actors, on any node of the cluster ``ray_address`` names); torch.distributed
    over gloo on CPU, NCCL on CUDA, either way."""
    data_parallel_size: int = 1
    """Engine replicas (Ray actors) behind one server (``router.py``)."""
    ray_address: str | None = None
    """The Ray cluster the replicas (or Ray ranks) join (``ray.init(address=...)``); None:
    the running one, else a local one."""
    data_parallel_routing: str = "cache_aware"
    """How the server picks a replica: cache_aware (longest cached prefix, balanced with
    requests in flight) or round_robin."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise InvalidRequestError(
                f"distributed_executor_backend={self.distributed_executor_backend!r} is "
                f"unknown; use one of {', '.join(EXECUTOR_BACKENDS)}"
            )
        if self.data_parallel_routing not in ROUTING:
            raise InvalidRequestError(
                f"data_parallel_routing={self.data_parallel_routing!r} is unknown; use one of "
                f"{', '.join(ROUTING)}"
            )
        needs_ray = self.data_parallel_size > 1 or self.distributed_executor_backend == "ray"
        if needs_ray and importlib.util.find_spec("ray") is None:
            what = (
                f"data_parallel_size={self.data_parallel_size} runs its replicas"
                if self.data_parallel_size > 1
                else "distributed_executor_backend='ray' runs its workers"
            )
            raise InvalidRequestError(f"{what} on Ray, which is not installed: {RAY_EXTRA}")

    @property
    def stages_overlap(self) -> bool:
        """Whether pipeline stages can work on two steps at once (``executor/pipelined.py``):
        more than one stage, each one rank. With tensor parallelism too they take turns:
        the last stage's other TP ranks get the rows to score from the driver's broadcast,
        which every rank hears, so two steps' messages would cross there (not built)."""
        return self.pipeline_parallel_size > 1 and self.tensor_parallel_size == 1

    @property
    def world_size(self) -> int:
        """Ranks of one engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def check_shapes(
    hf_config: dict, tp: int, model_name: str, problems: list[str] | None = None
) -> None:
    """Raise ``InvalidRequestError`` when ``tp`` ranks can not split this architecture:
    query heads, MLP width must divide; KV heads must divide or be divided by ``tp``
    (fewer KV heads than ranks: each is replicated on ``tp / kv_heads`` ranks).
    ``problems``: a hybrid family's own list (``hybrid_split``) instead of these."""
    from tokenmill.models.config import ArchConfig

    if problems is None:
        problems = attention_problems(ArchConfig.from_hf(hf_config), tp)
    if problems:
        raise InvalidRequestError(
            f"tensor_parallel_size={tp} can not split {model_name}: {'; '.join(problems)}. "
            "Use a size that divides the head counts"
        )


def attention_problems(cfg: ArchConfig, tp: int, mlp: bool = True) -> list[str]:
    """Why ``tp`` ranks can not split the attention heads (and the MLP width) of ``cfg``."""
    kv = cfg.num_kv_heads
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads={cfg.num_heads} is not divisible by {tp}")
    if (kv % tp) if kv >= tp else (tp % kv):
        problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by {tp}")
    if mlp and cfg.intermediate_size % tp:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by {tp}")
    return problems


def check_devices(parallel: ParallelConfig, visible: int) -> None:
    """Raise ``InvalidRequestError`` when the mp backend's ranks (one CUDA device each, rank
    r on cuda:r) outnumber the ``visible`` devices."""
    if parallel.world_size > visible:
        raise InvalidRequestError(
            f"tensor_parallel_size={parallel.tensor_parallel_size} x pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size} is {parallel.world_size} ranks, one CUDA "
            f"device each, but {visible} are visible: use sizes whose product is at most "
            f"{visible}, or distributed_executor_backend='ray' with a cluster's GPUs"
        )

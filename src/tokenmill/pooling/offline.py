"""``LLM.embed / classify / score / encode``: the offline pooling API (vLLM's names).

``PoolingMixin`` is a base of ``LLM``; ``LLM.__init__`` calls ``_load_pooling`` first,
which loads a ``PoolingEngine`` when the checkpoint (or ``runner=``) says pooling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.pooling.engine import PoolingEngine, Prompt
from tokenmill.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.pooling.params import POOLING_TASKS, PoolingParams
from tokenmill.pooling.score import pair_up, score_plan
from tokenmill.pooling.task import plan_pooling

PromptsIn = Prompt | dict | Sequence[Prompt | dict]


class PoolingMixin:
    engine: Any
    _counter: int

    def _load_pooling(self, config: EngineConfig) -> bool:
        """Load a pooling engine when ``config`` describes a pooling model; False otherwise."""
        plan = plan_pooling(config)
        if plan is None:
            return False
        self.engine = PoolingEngine(config, plan)
        return True

    def _pooling_engine(self, what: str) -> PoolingEngine:
        engine = self.engine
        if engine is None:
            raise EngineDeadError("this LLM was closed; create a new one")
        if not isinstance(engine, PoolingEngine):
            raise InvalidRequestError(
                f"llm.{what}() needs a pooling model, and this one was loaded for generation; "
                "load an embedding / classification checkpoint, or pass runner='pooling' "
                "(with convert='embed' or 'classify')"
            )
        return engine

    # -- the API -------------------------------------------------------------------------
    def encode(
        self,
        prompts: PromptsIn,
        pooling_params: PoolingParams | None = None,
        *,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Raw pooling output per prompt: ``pooling_task`` embed, token_embed, classify,
        token_classify or score (default: the model's task). ``use_tqdm`` is accepted for vLLM's signature;
        pooling shows no progress bar."""
        engine = self._pooling_engine("encode")
        task = pooling_task or engine.task
        if task not in POOLING_TASKS:
            raise InvalidRequestError(
                f"pooling_task={task!r} is unknown; use one of {', '.join(POOLING_TASKS)}"
            )
        outs = self._pool_run(task, prompts, pooling_params, truncate_prompt_tokens)
        return [PoolingRequestOutput(rid, PoolingOutput(t), ids) for rid, t, ids in outs]

    def embed(
        self,
        prompts: PromptsIn,
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, token ids, or {"prompt"/"prompt_token_ids"})."""
        outs = self._pool_run("embed", prompts, pooling_params, truncate_prompt_tokens)
        return [
            EmbeddingRequestOutput(rid, EmbeddingOutput(t.tolist()), ids) for rid, t, ids in outs
        ]

    def classify(
        self,
        prompts: PromptsIn,
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (a ``*ForSequenceClassification`` checkpoint)."""
        outs = self._pool_run("classify", prompts, pooling_params, truncate_prompt_tokens)
        return [
            ClassificationRequestOutput(rid, ClassificationOutput(t.tolist()), ids)
            for rid, t, ids in outs
        ]

    def reward(
        self,
        prompts: PromptsIn,
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """vLLM's ``reward``: ``encode(..., pooling_task="token_classify")``, the class
        probabilities of every token [num_tokens, num_labels] (raw logits with
        ``PoolingParams(activation=False)``), from a ``*ForTokenClassification``."""
        return self.encode(
            prompts,
            pooling_params,
            pooling_task="token_classify",
            truncate_prompt_tokens=truncate_prompt_tokens,
        )

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        pooling_params: PoolingParams | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs, 1 -> 1, 1 -> N (the one text against each) or N -> N:
        cosine of embeddings, or a cross-encoder's score. ``chat_template`` is for
        decoder rerankers, which are not supported yet (must be None)."""
        engine = self._pooling_engine("score")
        if chat_template is not None:
            raise InvalidRequestError(
                "chat_template applies to decoder rerankers, which this model is not"
            )
        truncate = truncate_prompt_tokens
        if truncate is None and pooling_params is not None:
            truncate = pooling_params.truncate_prompt_tokens
        firsts, seconds = pair_up(data_1, data_2)
        encoded, task, combine = score_plan(engine, firsts, seconds, truncate)
        scores = combine(engine.run(encoded, task))
        if task == "score":
            ids = [e.token_ids for e in encoded]
        else:  # embeddings: a pair's prompt is its two texts' ids, as vLLM reports
            by_text = dict(zip(dict.fromkeys([*firsts, *seconds]), encoded, strict=True))
            ids = [
                by_text[a].token_ids + by_text[b].token_ids
                for a, b in zip(firsts, seconds, strict=True)
            ]
        return [
            ScoringRequestOutput(self._pool_id(), ScoringOutput(s), i)
            for s, i in zip(scores, ids, strict=True)
        ]

    # -- helpers -----------------------------------------------------------------------------
    def _pool_run(
        self, task: str, prompts: PromptsIn, pooling_params, truncate
    ) -> list[tuple[str, Any, list[int]]]:
        engine = self._pooling_engine(task)
        items = _prompts(prompts)
        params = _params(pooling_params, truncate)
        encoded = engine.prepare(items, params, task)
        raw = engine.run(encoded, task)
        return [
            (self._pool_id(), engine.finish(r, params, task), e.token_ids)
            for r, e in zip(raw, encoded, strict=True)
        ]

    def _pool_id(self) -> str:
        self._counter += 1
        return f"pool-{self._counter}"


def _prompts(prompts: PromptsIn) -> list[Prompt]:
    """str | token ids | {"prompt" / "prompt_token_ids"} | a list of them -> texts / id lists."""
    items: Sequence[Any]
    if isinstance(prompts, str | dict):
        items = [prompts]
    elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        items = [prompts]  # one prompt as token ids
    else:
        items = prompts
    out: list[Prompt] = []
    for p in items:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise InvalidRequestError(
                    f"a prompt dict needs 'prompt' or 'prompt_token_ids', got {sorted(p)}"
                )
        elif isinstance(p, str) or (isinstance(p, Sequence) and all(isinstance(t, int) for t in p)):
            out.append(p)
        else:
            raise InvalidRequestError(
                f"a prompt must be a string or a list of token ids, got {type(p).__name__}"
            )
    return out


def _params(
    params: PoolingParams | Sequence[PoolingParams] | None, truncate: int | None
) -> PoolingParams:
    if params is not None and not isinstance(params, PoolingParams):
        raise InvalidRequestError("pooling_params must be one PoolingParams (one per call)")
    p = params.clone() if params is not None else PoolingParams()
    if truncate is not None:
        p.truncate_prompt_tokens = truncate
        p.__post_init__()
    return p

"""Draft-model proposals: a second, smaller model in the same engine guesses k tokens.

The draft has its own paged KV cache (with prefix caching) and its own runner. Each
request has a draft-side mirror (``DraftSeq``): the same token ids as the target's request
(the prompt was rendered once, with the target's template) and how many of them have
draft KV. A proposal is one catch-up step per batch (the tokens since the last proposal:
the whole prompt for a new request) that samples the first draft, then k - 1 one-token
steps; drafts are greedy (a point mass: the target's verification by exact match keeps
its own distribution whatever the drafts are). Next time the drafts the target accepted
keep their draft KV; the rest is rolled back (``KVCacheManager.truncate``).

The vocabularies must agree token for token (``check_same_vocab``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.scheduler.request import Request

if TYPE_CHECKING:
    from tokenmill.kv_cache import KVCacheManager
    from tokenmill.spec_decode.config import SpeculativeConfig
    from tokenmill.spec_decode.registry import TargetParts
    from tokenmill.tokenizer.tokenizer import Tokenizer
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0, max_tokens=1)


def check_same_vocab(target: Tokenizer, draft: Tokenizer) -> None:
    """Every target token must have the same id in the draft (ValueError naming the first
    that does not, with both ids)."""
    mine, theirs = target.hf.get_vocab(), draft.hf.get_vocab()
    for token, tid in sorted(mine.items(), key=lambda kv: kv[1]):
        did = theirs.get(token)
        if did != tid:
            raise InvalidRequestError(
                f"the draft model's vocabulary differs from the target's: token {token!r} is "
                f"id {tid} in the target and {'missing' if did is None else f'id {did}'} in "
                "the draft; use a draft of the same tokenizer family"
            )


@dataclass
class DraftSeq:
    """The draft's view of one request."""

    mirror: Request
    """The request's known tokens (drafts appended while proposing, removed after)."""
    computed: int = 0
    """Leading tokens with draft KV."""
    base: int = 0
    """Known tokens at the last proposal."""
    proposed: list[int] = field(default_factory=list)


class DraftModelProposer:
    """``Proposer`` of draft-model drafts (vLLM's method ``draft_model``)."""

    name = "draft_model"
    costly = True

    def __init__(
        self, runner: ModelRunner, kv: KVCacheManager, vocab_size: int, max_model_len: int
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.vocab_size = vocab_size
        """The target's vocabulary rows: a draft id at or past it is never proposed."""
        self.max_model_len = max_model_len
        self._seqs: dict[str, DraftSeq] = {}

    @classmethod
    def build(cls, spec: SpeculativeConfig, target: TargetParts) -> DraftModelProposer:
        from tokenmill.engine.loading import kv_cache_blocks, load_model
        from tokenmill.kv_cache import KVCacheManager, make_kv_cache
        from tokenmill.quant.plan import ActivationPrecisionError
        from tokenmill.sampling import Sampler
        from tokenmill.worker.fast_path import NativeDecodePath
        from tokenmill.worker.model_runner import allocate_kv_caches, make_runner

        assert spec.model is not None
        config = dataclasses.replace(
            target.config, model=spec.model, tokenizer=None, speculative_config=None,
            speculative_method=None, draft_model_id_or_path=None, num_speculative_tokens=None,
            max_model_len=target.loaded.max_model_len,
            quantization=spec.quantization or target.config.quantization,
        )  # fmt: skip
        logger.info("speculative decoding: loading the draft model %s", spec.model)
        try:
            loaded = load_model(config)
        except ActivationPrecisionError:  # raised before any weight is read
            # the target's "low" does not apply to these weights: a draft's precision
            # moves only its acceptance, so the draft takes the default
            logger.info("the draft model keeps activation_precision='high'")
            config = dataclasses.replace(config, activation_precision="high")
            loaded = load_model(config)
        check_same_vocab(target.loaded.tokenizer, loaded.tokenizer)
        blocks = kv_cache_blocks(config, loaded)
        kv = make_kv_cache(
            loaded.model.cache_specs(), blocks, config.block_size, config.enable_prefix_caching,
            max_blocks_per_seq=-(-loaded.max_model_len // config.block_size),
            num_slots=config.max_num_seqs,
        )  # fmt: skip
        if not isinstance(kv, KVCacheManager):
            raise InvalidRequestError(
                f"draft model {spec.model}: only attention-only drafts are supported"
            )
        caches = allocate_kv_caches(
            loaded.model, blocks, config.block_size, loaded.dtype, loaded.device
        )
        sampler = Sampler(torch.Generator(device=loaded.device).manual_seed(config.seed))
        runner = make_runner(
            config, loaded.model, caches, loaded.device, sampler, loaded.max_model_len
        )
        if isinstance(runner.decode, NativeDecodePath):  # catch-up steps: 1 + accepted
            runner.decode.short_chunks = spec.num_speculative_tokens + 1
        return cls(runner, kv, target.loaded.model.vocab_size, loaded.max_model_len)

    # -- Proposer -------------------------------------------------------------------------
    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        seqs = {req.request_id: self._catch_up(req, k) for req in requests}
        live = [req for req in requests if seqs[req.request_id] is not None]
        drafts: dict[str, list[int]] = {req.request_id: [] for req in requests}
        if live:
            self._draft(live, k, drafts)
        return [drafts[req.request_id] for req in requests]

    def finish(self, request: Request) -> None:
        if self._seqs.pop(request.request_id, None) is not None:
            self.kv.free(request.request_id)

    # -- steps ----------------------------------------------------------------------------
    def _catch_up(self, req: Request, k: int) -> DraftSeq | None:
        """Sync the mirror with the request, keep the KV of accepted drafts, and make room
        for k drafts; None when the draft cache is full (no drafts for it this step)."""
        rid, tokens = req.request_id, req.all_token_ids
        seq = self._seqs.get(rid)
        if seq is None:
            mirror = Request(rid, list(req.prompt_token_ids), _GREEDY, 1 << 30, frozenset())
            mirror.output_token_ids = list(req.output_token_ids)
            mirror.all_token_ids = list(tokens)
            seq = self._seqs[rid] = DraftSeq(mirror)
            seq.computed = self.kv.get_computed_blocks(rid, tokens, req.cache_key, True)
        else:
            new, with_kv = tokens[seq.base :], seq.computed - seq.base
            kept = 0  # the fed drafts have draft KV: each one the target accepted keeps it
            while kept < min(with_kv, len(new)) and new[kept] == seq.proposed[kept]:
                kept += 1
            seq.computed = seq.base + kept
        mirror = seq.mirror  # it holds the tokens known at its last proposal: extend it
        known = len(mirror.all_token_ids)
        mirror.all_token_ids.extend(tokens[known:])
        mirror.output_token_ids.extend(req.output_token_ids[mirror.num_output_tokens :])
        seq.computed = min(seq.computed, len(tokens) - 1)  # the last token gives the logits
        self.kv.truncate(rid, seq.computed)
        if len(tokens) + k > self.max_model_len or not self.kv.allocate_slots(rid, len(tokens) + k):
            self.finish(req)
            return None
        return seq

    def _draft(self, requests: list[Request], k: int, drafts: dict[str, list[int]]) -> None:
        """One catch-up step, then k - 1 one-token steps, for all ``requests`` at once."""
        seqs = [self._seqs[r.request_id] for r in requests]
        bases = {id(s): len(s.mirror.all_token_ids) for s in seqs}
        chunks = [(s, s.computed, len(s.mirror.all_token_ids) - s.computed) for s in seqs]
        for step in range(k):
            going = []
            for (s, _, _), token in zip(chunks, self._step(chunks)):
                if token >= self.vocab_size:
                    continue  # an id the target does not have: this draft ends here
                drafts[s.mirror.request_id].append(token)
                if step < k - 1:
                    s.mirror.append_token(token)  # fed to the next step: it gets draft KV
                    going.append((s, len(s.mirror.all_token_ids) - 1, 1))
            chunks = going
            if not chunks:
                break
        for s in seqs:
            base, rid = bases[id(s)], s.mirror.request_id
            s.computed = len(s.mirror.all_token_ids)  # the known tokens and the fed drafts
            s.mirror.truncate_output(s.mirror.num_output_tokens - (s.computed - base))
            s.base, s.proposed = base, drafts[rid]
            self.kv.commit(rid, s.mirror.all_token_ids, base, s.mirror.cache_key)

    def _step(self, chunks: list[tuple[DraftSeq, int, int]]) -> list[int]:
        """One draft forward pass over (seq, start, tokens) chunks -> the token sampled
        after each chunk."""
        scheduled = []
        for seq, start, n in chunks:
            table, row = self.kv.table_and_row(seq.mirror.request_id)
            scheduled.append(ScheduledSeq(seq.mirror, start, n, table, True, row))
        out = self.runner.collect(
            self.runner.launch(SchedulerOutput(tuple(scheduled), tables=self.kv.tables))
        )
        return [t[0] for t in out.tokens]

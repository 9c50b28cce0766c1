"""Hypothesis strategies over the ``deadweight.v1`` schema: valid, hostile and absurd batches.

Every field can take its extreme values: NaN and infinities in doubles, the full int64 range,
strings far beyond the sidecar's caps, maps with more entries than allowed, unknown run ids,
repeated and out-of-order sequence numbers. A few run ids recur so batches hit live runs.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from deadweight.proto import pb

RUN_IDS = [f"run-{i}" for i in range(6)]
LOG_KEYS = ["loss", "grad_norm", "learning_rate", "kl", "reward", "reward_std",
            "frac_reward_zero_std", "entropy", "completions/mean_length", "epoch"]

int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
uint64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 40)
counts = st.one_of(small, int64)
doubles = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -0.0, float("nan"), float("inf"), float("-inf")]))


def _long(n: int, char: str) -> str:
    return char * n


#: Mostly short text, sometimes non-printable, sometimes far past every cap.
texts = st.one_of(
    st.text(max_size=12),
    st.text(max_size=12),
    st.builds(_long, st.integers(100, 6000), st.sampled_from(["a", "\x00", "é", "\n", "{"])),
)


def _wide(n: int) -> dict[str, float]:
    return {f"key{i}": float(i) for i in range(n)}


float_maps = st.one_of(
    st.dictionaries(st.one_of(st.sampled_from(LOG_KEYS), texts), doubles, max_size=6),
    st.builds(_wide, st.sampled_from([0, 2000])),
)
text_maps = st.dictionaries(texts, texts, max_size=4)
short_lists = st.lists(texts, max_size=3)

digests = st.builds(
    pb.AdapterDigest, combined=texts,
    tensors=st.dictionaries(texts, st.text(max_size=32), max_size=4), bytes=int64,
)

run_starts = st.builds(
    pb.RunStart,
    trainer=st.one_of(st.sampled_from(["GRPOTrainer", "SFTTrainer"]), texts),
    world_size=int32,
    output_dir=texts,
    config=float_maps,
    config_text=text_maps,
    versions=text_maps,
    membership=st.builds(
        pb.OptimizerMembership,
        optimizer_tensors=counts, optimizer_params=counts, trainable_tensors=counts,
        trainable_params=counts, trainable_not_in_optimizer_tensors=counts,
        adapter_tensors=counts, adapter_params=counts,
        adapters=st.lists(st.builds(pb.AdapterCoverage, name=texts, tensors=counts,
                                    params=counts, in_optimizer_tensors=counts,
                                    active=st.booleans()), max_size=3),
    ),
    preflight=st.builds(
        pb.Preflight, is_peft=st.booleans(), peft_type=texts,
        requested_target_modules=short_lists, unmatched_target_modules=short_lists,
        embedding_rows=counts, base_vocab_size=counts, tokenizer_size=counts,
        modules_to_save=short_lists, active_adapter=texts, lora_rank=counts,
    ),
    initial_adapter=digests,
    sharded=st.booleans(),
    host=texts,
)

steps = st.builds(
    pb.StepReport,
    step=counts, learning_rate=doubles, update_sq_sum=doubles, param_sq_sum=doubles,
    watched_tensors=counts, watched_params=counts, optimizer_params=counts,
    unchanged_tensors=counts, grad_not_in_optimizer_tensors=counts,
    nonfinite_update_tensors=counts, grad_sq_sum=doubles,
    groups=st.lists(st.builds(pb.GroupUpdate, name=texts,
                              kind=st.one_of(st.sampled_from(["adapter", "module"]), texts),
                              update_sq_sum=doubles, tensors=counts,
                              unchanged_tensors=counts), max_size=3),
    sampled=st.booleans(), grad_not_in_optimizer_params=counts,
)

logs = st.builds(pb.LogReport, step=counts, values=float_maps, dropped_keys=counts)
checkpoints = st.builds(pb.CheckpointReport, step=counts, path=texts, adapter=digests)
heartbeats = st.builds(pb.Heartbeat, step=counts, dropped_events=counts, queued_events=counts)
run_ends = st.builds(pb.RunEnd, step=counts, reason=texts)

BODIES: dict[str, Any] = {
    "run_start": run_starts, "step": steps, "log": logs, "checkpoint": checkpoints,
    "heartbeat": heartbeats, "run_end": run_ends,
}


def _event(kind: str | None, body: Any, seq: int, at: float) -> pb.Event:
    if kind is None:
        return pb.Event(seq=seq, time_seconds=at)  # no body at all
    return pb.Event(seq=seq, time_seconds=at, **{kind: body})


seqs = st.one_of(small, uint64)
events = st.one_of(
    *(st.builds(_event, st.just(kind), body, seqs, doubles) for kind, body in BODIES.items()),
    st.builds(_event, st.none(), st.none(), seqs, doubles),
)

run_ids = st.one_of(st.sampled_from(RUN_IDS), st.sampled_from(RUN_IDS), texts)
requests = st.builds(
    pb.StreamRequest,
    run_id=run_ids,
    rank=st.one_of(st.integers(0, 3), int32),
    events=st.lists(events, max_size=5),
)

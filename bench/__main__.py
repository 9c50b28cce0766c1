"""Run every benchmark: ``python -m bench [--quick] [--only NAME ...]``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from . import update_pass
from .common import measure_bandwidth, setup_torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--only", nargs="*", default=None,
                        help="subset of: update_pass full_ft checkpoint sidecar sidecar_trust "
                             "sidecar_memory sidecar_ranks attest_flood stop_agreement train_step "
                             "step_marks")
    parser.add_argument("--device", default="cpu",
                        help="where the weights live: cpu (default) or cuda (the update pass "
                             "and the training step then run there)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cuda = args.device != "cpu"
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    setup_torch()
    repeats = 5 if args.quick else 11
    only = set(args.only or [])

    def wanted(name: str) -> bool:
        return not only or name in only

    print(f"# deadweight bench ({'quick' if args.quick else 'full'}), torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, threads={torch.get_num_threads()}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    from deadweight.callbacks.update import native as update_native

    print(f"native kernel: {update_native.describe()}")
    copy_bw, read_bw = measure_bandwidth(repeats)
    print(f"memory bandwidth (1 thread, 256 MiB): copy {copy_bw / 1e9:.1f} GB/s "
          f"(read+write bytes), read {read_bw / 1e9:.1f} GB/s")
    if wanted("update_pass"):
        if cuda:
            update_pass.run_device(args.device, repeats, args.quick)
        else:
            update_pass.run(copy_bw, repeats, args.quick)
    if wanted("full_ft"):
        from . import full_ft
        full_ft.run(copy_bw, repeats, args.quick)
    if wanted("checkpoint"):
        from . import checkpoint_hash
        checkpoint_hash.run(repeats, args.quick)
    if wanted("sidecar"):
        from . import sidecar_load
        sidecar_load.run(repeats, args.quick)
    if wanted("sidecar_trust"):
        from . import sidecar_trust
        sidecar_trust.run(repeats, args.quick)
    if wanted("sidecar_memory"):
        from . import sidecar_memory
        sidecar_memory.run(repeats, args.quick)
    if wanted("sidecar_ranks"):
        from . import sidecar_ranks
        sidecar_ranks.run(repeats, args.quick)
    if wanted("attest_flood"):
        from . import attest_flood
        attest_flood.run(repeats, args.quick)
    if wanted("fsdp2_probe"):
        from . import fsdp2_probe
        fsdp2_probe.run(repeats, args.quick)
    if wanted("stop_agreement"):
        from . import stop_agreement
        stop_agreement.run(repeats, args.quick)
    if wanted("train_step"):
        from . import train_step
        train_step.run(repeats, args.quick, args.device)
    if wanted("step_marks"):
        from . import step_marks
        step_marks.run(repeats, args.quick, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

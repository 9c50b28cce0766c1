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
                        help="subset of: update_pass full_ft checkpoint sidecar train_step")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    setup_torch()
    repeats = 5 if args.quick else 11
    only = set(args.only or [])

    def wanted(name: str) -> bool:
        return not only or name in only

    print(f"# deadweight bench ({'quick' if args.quick else 'full'}), torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, threads={torch.get_num_threads()}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    copy_bw, read_bw = measure_bandwidth(repeats)
    print(f"memory bandwidth (1 thread, 256 MiB): copy {copy_bw / 1e9:.1f} GB/s "
          f"(read+write bytes), read {read_bw / 1e9:.1f} GB/s")
    if wanted("update_pass"):
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
    if wanted("fsdp2_probe"):
        from . import fsdp2_probe
        fsdp2_probe.run(repeats, args.quick)
    if wanted("train_step"):
        from . import train_step
        train_step.run(repeats, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())

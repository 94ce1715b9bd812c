"""Peak resident memory of ``objckpt convert`` / ``objckpt export`` on a few-hundred-MB checkpoint.

Builds one state of ``--tensors`` float32 tensors of ``--tensor-mb`` MB each as a DCP
directory, a torch.save file and a safetensors file, then runs each conversion
(and objckpt -> DCP, objckpt -> HF safetensors) in a fresh process and prints
its peak RSS (``VmHWM``) above the RSS it had after imports.  Streaming
conversion should stay near one tensor plus a few upload parts (16 MiB each).

    python benchmarks/bench_convert_rss.py --dir /tmp/rss [--tensors 24 --tensor-mb 12]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint, objckpt
from objckpt.integrations.convert import convert
from objckpt.integrations.hf import export_safetensors

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
kind, src, dst = sys.argv[1:4]
base = rss("VmRSS:")
if kind == "export":
    export_safetensors(src, dst)
else:
    convert(src, dst, dst_format=kind)
print(json.dumps({"base": base, "peak": rss("VmHWM:")}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--tensor-mb", type=int, default=12)
    a = ap.parse_args()
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    os.makedirs(a.dir, exist_ok=True)
    rows = a.tensor_mb * (1 << 20) // (4 * 1024)
    state = {f"layer{i}.weight": torch.randn(rows, 1024) for i in range(a.tensors)}
    total = sum(t.numel() * 4 for t in state.values())
    paths = {"dcp": f"{a.dir}/dcp", "torch": f"{a.dir}/state.pt", "safetensors": f"{a.dir}/state.safetensors"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=paths["dcp"], no_dist=True)
    torch.save(state, paths["torch"])
    save_file(state, paths["safetensors"])
    del state
    runs = [(f"{k} -> objckpt", "objckpt", p, f"{a.dir}/ck-{k}") for k, p in paths.items()]
    runs += [("objckpt -> dcp", "dcp", f"{a.dir}/ck-dcp", f"{a.dir}/dcp-back"),
             ("objckpt -> HF safetensors (export)", "export", f"{a.dir}/ck-dcp", f"{a.dir}/hf")]
    print(f"state: {a.tensors} x {a.tensor_mb} MB float32 = {total / 1e6:.0f} MB")
    for label, kind, src, dst in runs:
        out = subprocess.run([sys.executable, "-c", CHILD, kind, src, dst], capture_output=True, text=True)
        if out.returncode:
            print(label, "FAILED", out.stderr[-2000:])
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{label:<36} peak RSS {r['peak'] / 1e6:7.0f} MB, {(r['peak'] - r['base']) / 1e6:6.0f} MB above "
              f"the {r['base'] / 1e6:.0f} MB after imports")


if __name__ == "__main__":
    main()

"""The Stateful and meta-device recipes (examples/integrations/) run against moto S3.

The Stateful recipe runs as users run it, a script in its own process with the
S3 endpoint in ``AWS_ENDPOINT_URL``; the meta-device one in this process, also
without its buffer fix-up, to show the fix-up is what makes it right.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "integrations")
sys.path.insert(0, EXAMPLES)


def test_stateful_recipe_script(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    env = {**os.environ, "AWS_ENDPOINT_URL": opts["endpoint_url"], "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "stateful.py"), f"s3://{bucket}/stateful"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["resumed"] == out["reference"] and out["step"] == 10
    assert "optim.state.3.exp_avg_sq" in out["keys"] and "model.2.weight" in out["keys"]


def test_meta_device_recipe(moto_s3: tuple[str, dict[str, Any]]) -> None:
    import meta_device

    bucket, opts = moto_s3
    out = meta_device.main(f"s3://{bucket}/meta", opts)
    assert out == {"same_state": True, "same_logits": True, "tied": True}
    # without re-tying and recomputing the non-persistent rotary buffers, the state dict is
    # restored but the model is not the saved one
    out = meta_device.main(f"s3://{bucket}/meta", opts, fix_buffers=False)
    assert out["same_state"] and not out["same_logits"] and not out["tied"], out

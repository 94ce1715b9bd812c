"""A CheckpointManager whose root is a torch.distributed.checkpoint (DCP) run refuses it.

``latest_step()`` None is how a job decides to start from scratch, so a manager pointed
at a DCP directory (or at a root of DCP step folders) used to leave that run behind
without a word.  Now the first read of the root raises :class:`DcpDirectoryError`
naming the DCP folder and ``objckpt convert``; the check reads the listing the index
already makes of a root without an index, so it costs no request.  Real DCP saves
(local files; s3fs on moto), the manager in a new process, requests counted on the wire.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import DcpDirectoryError, NotFoundError, UnsupportedFormatError
from objckpt.tier.settings import TierSettings
from testkit.http_count import CountingProxy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _dcp_save(where: str, opts: Any = None) -> None:
    """A real DCP checkpoint at ``where`` (a path, or s3:// through s3fs)."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": {"w": torch.randn(8, 4)}, "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if where.startswith("s3://"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            from objckpt.integrations.sources import fsspec_options

            dcp.save(sd, storage_writer=FsspecWriter(where, **fsspec_options(where, opts)), no_dist=True)
        else:
            dcp.save(sd, checkpoint_id=where, no_dist=True)


def _latest_in_new_process(*roots: tuple[str, Any, dict[str, Any]]) -> list[dict[str, Any]]:
    """``CheckpointManager(root, ...).latest_step()`` for each (root, storage options, manager
    keywords), as a training script runs it, in one new process: the error's class and
    text, or the step."""
    code = textwrap.dedent(f"""
        import json, objckpt
        for root, opts, kw in {list(roots)!r}:
            m = objckpt.CheckpointManager(root, storage_options=opts, no_dist=True, **kw)
            try:
                print(json.dumps({{"step": m.latest_step()}}))
            except Exception as e:
                print(json.dumps({{"error": type(e).__name__, "text": str(e)}}))
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.strip().splitlines()[-len(roots):]]


def test_a_local_dcp_directory_or_dcp_step_folders_as_root_are_refused_naming_them_and_convert(
        tmp_path: Path) -> None:
    """The root itself, or a DCP run saved one folder per step (``checkpoint-100/``...): the
    manager's own step format does not name those folders, so it saw an empty root."""
    root = str(tmp_path / "run")
    _dcp_save(root)
    steps = tmp_path / "steps"
    for step in (100, 200, 300, 400):
        _dcp_save(str(steps / f"checkpoint-{step}"))
    got, in_folders = _latest_in_new_process((root, None, {}), (str(steps), None, {"step_format": "step_{step}"}))
    assert got["error"] == "DcpDirectoryError", got
    assert f"{root!r} is a torch.distributed.checkpoint (DCP) directory" in got["text"]
    assert f"objckpt convert {root} <new root>/step-<step>" in got["text"]
    assert in_folders["error"] == "DcpDirectoryError", in_folders
    assert ("holds torch.distributed.checkpoint (DCP) checkpoints (checkpoint-100, checkpoint-200, checkpoint-300 "
            "and 1 more: a .metadata in each)") in in_folders["text"]
    assert f"objckpt convert {steps}/checkpoint-100 <new root>/step_<step>" in in_folders["text"]
    # in this process too: not a FileNotFoundError (code that starts afresh on one must not swallow it),
    # and save() and load() refuse the root as well, before writing anything beside the DCP run
    m = objckpt.CheckpointManager(root, no_dist=True)
    with pytest.raises(DcpDirectoryError) as e:
        m.latest_step()
    assert isinstance(e.value, UnsupportedFormatError) and not isinstance(e.value, FileNotFoundError)
    with pytest.raises(DcpDirectoryError):
        m.save(1, {"x": torch.ones(2)})
    with pytest.raises(DcpDirectoryError):
        m.load({"x": torch.ones(2)})
    m.close()
    assert sorted(os.listdir(root)) == [".metadata", "__0_0.distcp"]  # nothing written beside it


def test_what_the_error_advises_resumes_the_run(tmp_path: Path) -> None:
    """Converted into a step folder (the command line, as the message says), the DCP run is
    the manager's latest step; a DCP folder beside objckpt steps no longer matters."""
    dcp_dir, root = str(tmp_path / "dcp"), str(tmp_path / "run")
    _dcp_save(dcp_dir)
    r = subprocess.run([sys.executable, "-m", "objckpt", "convert", dcp_dir, f"{root}/step-0000000007"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    _dcp_save(str(tmp_path / "run" / "old-dcp"))
    assert _latest_in_new_process((root, None, {})) == [{"step": 7}]
    into = {"model": {"w": torch.zeros(8, 4)}, "step": 0}
    objckpt.CheckpointManager(root, no_dist=True).load(into)
    assert into["step"] == 7 and into["model"]["w"].abs().sum() > 0


def test_empty_and_objckpt_roots_are_unaffected(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with objckpt.CheckpointManager(root, no_dist=True) as m:
        m.save(3, {"x": torch.ones(2)})
    os.remove(tmp_path / "run" / "_objckpt_index" / "head.json")  # no hint: the index is found by listing
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    # nothing there: start from scratch, as before
    assert _latest_in_new_process((str(tmp_path / "empty"), None, {}), (root, None, {}),
                                  (str(tmp_path / "other"), None, {})) == [{"step": None}, {"step": 3}, {"step": None}]


def test_a_tiered_manager_refuses_it_too(tmp_path: Path) -> None:
    """The tier reads the root's steps as an outage would let it skip them (it restores from
    the local tiers then); a DCP root is no outage and is raised."""
    root = str(tmp_path / "run")
    _dcp_save(root)
    m = objckpt.CheckpointManager(root, no_dist=True, tier=TierSettings(local_dir=str(tmp_path / "local")),
                                  node_override="n0")
    try:
        with pytest.raises(DcpDirectoryError, match="objckpt convert"):
            m.latest_step()
        with pytest.raises(DcpDirectoryError, match="objckpt convert"):
            m.load({"x": torch.ones(2)})
        with pytest.raises(DcpDirectoryError, match="objckpt convert"):
            m.save(1, {"x": torch.ones(2)})
    finally:
        m.close()


def test_on_s3_a_dcp_root_is_refused_at_no_extra_request(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    _dcp_save(f"s3://{bucket}/dcp-run", opts)
    _dcp_save(f"s3://{bucket}/runs/ckpt_5", opts)
    got, in_folders = _latest_in_new_process((f"s3://{bucket}/dcp-run", opts, {}), (f"s3://{bucket}/runs", opts, {}))
    assert got["error"] == "DcpDirectoryError", got
    assert f"objckpt convert s3://{bucket}/dcp-run <new root>/step-<step>" in got["text"]
    assert in_folders["error"] == "DcpDirectoryError" and "(ckpt_5: a .metadata in each)" in in_folders["text"]
    with CountingProxy(opts["endpoint_url"]) as proxy:  # what each costs, on the wire
        popts = {**opts, "endpoint_url": proxy.url}
        with objckpt.CheckpointManager(f"s3://{bucket}/ours", storage_options=popts, no_dist=True) as m:
            m.save(2, {"x": torch.ones(2)})
        counts = {}
        for name in ("ours", "dcp-run", "empty"):
            proxy.reset()
            try:
                counts[name] = (objckpt.CheckpointManager(f"s3://{bucket}/{name}", storage_options=popts,
                                                          no_dist=True).latest_step(), proxy.counts())
            except DcpDirectoryError:
                counts[name] = ("refused", proxy.counts())
    assert counts["ours"][0] == 2 and "LIST" not in counts["ours"][1]  # an indexed root is never listed
    # a DCP root costs what an empty root costs: the hint's GET (absent) and the listing
    assert counts["dcp-run"] == ("refused", {"GET": 1, "LIST": 1}), counts
    assert counts["empty"] == (None, {"GET": 1, "LIST": 1}), counts


def test_load_still_says_not_found_for_a_dcp_directory(tmp_path: Path) -> None:
    """objckpt.load keeps its error (NotFoundError), worded as the manager's."""
    root = str(tmp_path / "run")
    _dcp_save(root)
    with pytest.raises(NotFoundError, match=rf"DCP\) directory .*objckpt convert {root} <new uri>"):
        objckpt.load({"x": torch.ones(2)}, root)

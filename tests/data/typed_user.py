"""A user's training script, type-checked with ``mypy --strict`` by tests/test_typing.py.

It must pass: every public call used the way the README shows, every result
attribute read with its type.  (``typed_user_wrong.py`` holds the calls that must fail.)
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import objckpt


def train_step(state: dict[str, Any], uri: str, opts: Optional[dict[str, Any]]) -> float:
    res: objckpt.SaveResult = objckpt.save(state, uri, storage_options=opts, overwrite=True,
                                           metadata={"git": "abc"}, part_size=8 << 20)
    seconds: float = res.seconds + res.gbps
    nbytes: int = res.bytes + res.requests + res.tensors + res.blobs + res.manifest_bytes
    phases: dict[str, float] = res.timings.phases
    handle: objckpt.SaveHandle = objckpt.async_save(state, uri + "-async", storage_options=opts, lazy=True,
                                                    max_in_flight=2, overwrite=True)
    handle.wait_staged(timeout=60.0)
    finished: bool = handle.done()
    later: objckpt.SaveResult = handle.result()
    loaded: objckpt.LoadResult = objckpt.load(state, uri, storage_options=opts, strict=False,
                                              read_strategy="direct", no_dist=True)
    missing: list[str] = loaded.missing_keys + loaded.unexpected_keys
    strategy: str = loaded.strategy
    got: dict[str, Any] = objckpt.read(uri, keys=["model.weight"], storage_options=opts)
    m = objckpt.inspect(uri, storage_options=opts, chunks=False)
    names: list[str] = m.keys
    meta: dict[str, Any] = m.metadata
    stored: int = m.nbytes()
    report: objckpt.CopyReport = objckpt.copy(uri, uri + "-copy", storage_options=opts, overwrite=True)
    same: objckpt.DiffReport = objckpt.diff(uri, uri + "-copy", storage_options=opts)
    equal: bool = same.equal
    deleted = objckpt.delete(uri + "-copy", storage_options=opts)
    shard = objckpt.Shard(torch.zeros(2, 3), (4, 3), (0, 0))
    del shard, deleted, report, names, meta, missing, strategy, got, phases, finished, later
    return seconds + nbytes + stored + float(equal)


def safe_load(state: dict[str, Any], uri: str) -> Optional[objckpt.LoadResult]:
    try:
        return objckpt.load(state, uri)
    except objckpt.BucketNotFoundError as e:
        print(e.bucket)
    except objckpt.NotFoundError:
        return None
    except (objckpt.CorruptCheckpointError, objckpt.BlobMissingError, objckpt.UnsupportedFormatError) as e:
        raise RuntimeError(str(e)) from e
    except (objckpt.StateDictMismatchError, objckpt.UnsupportedValueError, objckpt.CheckpointExistsError,
            objckpt.CollectiveLoadError, objckpt.RanksDidNotJoinError, objckpt.TensorChangedError,
            objckpt.StorageError, objckpt.MissingKeyError) as e:
        raise RuntimeError(str(e)) from e
    except objckpt.ObjckptError:
        raise
    return None


model = torch.nn.Linear(4, 4)
train_step({"model": model.state_dict(), "step": 1}, "s3://bucket/run/step-1", {"endpoint_url": "http://x"})

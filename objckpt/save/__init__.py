"""The save pipeline: describe -> exchange and plan -> stage -> upload -> commit.

* :mod:`.describe`: this rank's state as tensor boxes and sources.
* :mod:`.pipeline`: the three phases every save runs (prepare, upload, finish).
* :mod:`.upload`: staging parts into host buffers, crc32c, multipart uploads.
* :mod:`.records`: the chunk records and blobs a rank reports (every writer's).
* :mod:`.source`: saves whose tensors come from a source (the DCP plugin's write
  items, the converters' stream; :mod:`.streamed` uploads those in order).
* :mod:`.commit`: the manifest written last and conditionally.
* :mod:`.background`: ``async_save``'s driver; :mod:`.mirrors`: its host mirrors.
"""

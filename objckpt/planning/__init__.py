"""Pure planning: no storage, no I/O, no process-global caches.

* :mod:`.boxes`: boxes of a global tensor.
* :mod:`.assign`: who writes what, from every rank's boxes (format v1).
* :mod:`.symbolic`: who holds and wrote what, from DTensor placements (format v2).
* :mod:`.pack`: tensors into blobs, parts and chunks.
* :mod:`.read_plan`: stored chunks -> the byte ranges and copies a load needs.
* :mod:`.ranges`: byte ranges -> merged / split requests.
* :mod:`.collective_plan`: who reads what in a collective load, in which batches.
"""

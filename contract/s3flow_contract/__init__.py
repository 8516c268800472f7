"""The s3flow wire contract, shared by the servers and every client (numpy only, no torch, no server code).

* ``s3flow_contract.tensors``: every tensor that crosses a model boundary (names, dtypes, dims), the stream's
  geometry, and ``request_arrays``, the one request builder;
* ``s3flow_contract.answers``: what a client should do with an error answer (``Disposition``), as a tag in
  the message with a fixed grammar, and the table of Triton's own errors.
"""

"""The measurement drivers: each module is the command that made one results file (or a section of one), run from
the repository root as ``python -m s3flow_tools.measure.<name>`` (the default ``--out`` is under ``results/``); its
docstring says what each row is and when it exits non-zero, and ``--help`` lists its settings. Example::

    .venv/bin/python -m s3flow_tools.measure.failover --help

* ``ab``: this checkout's server against another checkout's, interleaved on one host (C, a stream alone) ->
  ``results/one_loop.md``
  ``python -m s3flow_tools.measure.ab --other /tmp/before``
* ``admission``: admission under overload, with and without the capacity check -> ``results/qos.md`` (its
  admission section)
  ``python -m s3flow_tools.measure.admission``
* ``batching``: server-side batching: one row per setting of a grid -> ``results/sweep.md``
  ``python -m s3flow_tools.measure.batching``
* ``conditioning``: what a streamed chunk must condition on: quality and served cost -> ``results/conditioning.md``
  ``python -m s3flow_tools.measure.conditioning``
* ``failover``: a server killed or drained mid-stream -> ``results/failover.md``
  ``python -m s3flow_tools.measure.failover``
* ``first_audio``: the first response of token2wav carrying sound -> ``results/first_audio.md``
  ``python -m s3flow_tools.measure.first_audio``
* ``lifecycle``: a killed client's sequence freed, the server's stop -> ``results/lifecycle.md``
  ``python -m s3flow_tools.measure.lifecycle``
* ``live``: tokens arriving live: first audio and stalls -> ``results/live_client.md``
  ``python -m s3flow_tools.measure.live``
* ``long_stream``: one long utterance through token2wav, bounded context -> ``results/long_stream.md``
  ``python -m s3flow_tools.measure.long_stream``
* ``overhead``: where a chunk's time goes on the served path, from Triton's traces -> ``results/overhead.md``
  ``python -m s3flow_tools.measure.overhead``
* ``qos``: streams under load, FIFO vs the deadline scheduler -> ``results/qos.md``
  ``python -m s3flow_tools.measure.qos``
* ``refusals``: refused STARTs hold nothing -> ``results/refusals.md``
  ``python -m s3flow_tools.measure.refusals``
* ``resume``: a resume from a snapshot costs one chunk -> ``results/failover.md`` (its resume section)
  ``python -m s3flow_tools.measure.resume``
* ``streaming``: streaming modes in process on the trained small model -> ``results/streaming.md``
  ``python -m s3flow_tools.measure.streaming``
* ``warmup``: cold start, warm-up off and on -> ``results/warmup.md`` (``--output``)
  ``python -m s3flow_tools.measure.warmup``

Each builds its command line with ``command`` (``python -m s3flow_tools.measure.<name>``, the docstring its help).
``admission`` and ``ab`` take their held-out sentences from ``qos`` (the same as the scheduler's table); nothing else imports
these modules. The product commands (build the repository, serve, stream, load test, benchmark, train) stay in
``scripts/``.
"""

"""s3flow: Chatterbox S3Gen's flow-matching token-to-mel decoder, packaged for serving on Triton.

Layers, lowest first; a module imports only from its own layer or lower ones (``tests/test_layers.py``). Below
them all sits the wire contract, a distribution of its own (``contract/``, numpy only): ``s3flow_contract.tensors``
(every tensor's name, dtype and dims) and ``s3flow_contract.answers`` (what a client does with an error).

- ``protocol``: request rules and validation (numpy only)
- ``model/``: the torch ports and their weights

  - ``estimator``: the CFM estimator, the causal ``ConditionalDecoder`` U-Net
  - ``encoder``: the flow encoder: speech tokens + x-vector -> (mu, mask, spks)
  - ``flow``: the whole flow in process (``S3Flow``, ``synthesize``)
  - ``solver``: the Euler solver, guidance as one 2B call, noise per (seed, frame)
  - ``chunks``: the one chunk pipeline (condition, lengths, mask, starting point)
  - ``flops``: the estimator's floating-point operations, counted from its config
  - ``vocoder``: HiFT (mel -> 24 kHz audio), its ``mel2wav.*`` checkpoint and seeded random weights
  - ``vocoder_source``: the neural source between the vocoder's two networks (numpy)
  - ``checkpoint``: the flow's checkpoint in the upstream layout (``flow.*``): read, load, write
  - ``checkpoint_io``: any module's tensors in a checkpoint file: read by prefix, write, compare
  - ``random_checkpoint``: seeded random weights, and whole random checkpoints (flow, voice, vocoder)
  - ``voice/``: the reference-audio front-end (audio -> speaker prompt)

    - ``frontend``: upstream's ``embed_ref`` on our modules, and input validation
    - ``tokenizer``: S3TokenizerV2, 16 kHz speech -> speech tokens
    - ``campplus``: CAM++, the 192-d speaker x-vector
    - ``mel``: the 24 kHz prompt mel and the tokenizer's log-mel
    - ``kaldi_fbank``: Kaldi fbank features (CAM++'s input)
    - ``resample``: band-limited resampling
    - ``weights``: its ``tokenizer.*`` / ``speaker_encoder.*`` checkpoint keys and seeded random weights

- ``runtime/``: the networks on a backend

  - ``onnx_export``: ONNX export of the estimator and the encoder, with ONNX Runtime parity checks
  - ``ort``: ONNX Runtime (CPU) sessions, the one session builder, as solver / engine callables
  - ``ort_rewrite``: the load-time CPU graph rewrite (Mish in exp form, fused attention)
  - ``torch_runner``: the estimator or encoder in torch on a device
  - ``devices``: which torch device a model instance runs on
  - ``vocoder``: the vocoder's ONNX export and check, offline ``vocode``
  - ``vocoder_runner``: the served vocoder's backend (``OnnxVocoder``, the runner's choice)
  - ``torch_vocoder``: the vocoder module on a torch device (``TorchVocoder``)
  - ``tensorrt/``: TensorRT engines built on the GPU that serves them

    - ``profiles``: the optimisation profiles, sized from the served shapes
    - ``fp16``: the fp16 copy of a graph, with fp32 islands
    - ``build``: the toolchain, cache names, building and installing an engine
    - ``engine``: running an engine over torch CUDA buffers; the estimator engine
    - ``parity``: an engine against the fp32 reference

- ``engine/``: Triton-free streaming state and the step mechanism

  - ``streaming``: the chunk engine (``StreamingEngine``): prefix and bounded-context modes, commit after success
  - ``chunk``: what a stream keeps between its chunks and what one chunk is (``SequenceState``, ``Chunk``,
    ``ChunkResult``), shared by the engine and the loop
  - ``sequences``: the one owner of a sequence's life (begin, serve, commit, roll back, end, evict) and of what
    each stream has had (its playback clock, its work); the sequence limits
  - ``settings``: the solver's settings (request rules, sequence limits, admission target, chunk solving,
    deadlines)
  - ``observer``: what the engine reports as it works
  - ``stepping``: one Euler step over the rows of many chunks in one estimator call
  - ``step_loop``: the one solving loop: chunks join, one step at a time, each answered once (both schedulings);
    it knows the engine only by what it calls (``ChunkEngine``)
  - ``scheduler``: which rows go into the next step (the policy: whole batches, least slack, arrival)
  - ``playback``: a stream's playback clock (its deadline and lead)
  - ``capacity``: the costs measured online, each stream's demand, the server's capacity, the admission target
  - ``planning``: an utterance's estimator calls and chunk work, planned over the real engine
  - ``snapshot``: sealed snapshots of a stream's state, what a resume starts from
  - ``solver_snapshot``: the solver's section of a snapshot
  - ``vocoder_snapshot``: the vocoder's section of a snapshot
  - ``vocoder_stream``: the vocoder's per-utterance state between mel chunks (numpy)
  - ``reuse``: what a stream keeps of the frames it solved (``keep_solved``)
  - ``voice_prompts``: the prompt caches registered voices hold (``voice_cache_mb``)

- ``serving/``: inside Triton

  - ``triton_models/``: the python-backend models, one per file over a shared base

    - ``base``: what every python model shares (config checks, one bad request never fails a batch)
    - ``cfm_solver``: the streaming solver (tensors in, responses out, over ``solver_instance``)
    - ``bls``: the solver's encoder and estimator calls over BLS
    - ``vocoder_model``: the vocoder, mel chunks in, final audio out (over ``vocoder_instance``)
    - ``voice_encoder_model``: reference audio in, voice id + prompt out
    - ``admission_model``: the ensembles' first step, refusing STARTs before the sequence batcher
    - ``onnx_model``: one ONNX file in ONNX Runtime (CPU hosts)
    - ``torch_model``: the estimator or encoder in torch on CUDA
    - ``metric_api``: the metric families through the python backend's metric API
    - ``slots``: giving Triton back a dropped sequence's slot

  - ``solver_instance``: one solver instance around its engine, without Triton: built from its parameters, its
    one way in and one way out (each request answered through its sender; fifo solves a batch whole, deadline
    queues each sequence's chunks on the step loop's thread), what it keeps in step with the other processes
  - ``vocoder_instance``: the same for one vocoder instance
  - ``session``: the solver's session: a batch of requests in, one outcome each, the failure table
  - ``local_stream``: one utterance streamed in process through the session (evaluation, benchmarks)
  - ``vocoder_session``: the vocoder's session: one request in, one outcome out
  - ``voice_registry``: speaker prompts stored once under a voice id
  - ``voice_service``: what the ``voice_encoder`` model does with one request
  - ``admission``: the checks a START passes before it gets a slot
  - ``records``: what crosses between instances: the schema, one writer each, written whole
  - ``load``: each instance's load report (live ids, cap, demand), summed where admission reads it
  - ``calibration``: the solver's capacity at load (planned work, timed calls)
  - ``arrivals``: requests counted from admission to the solver, answers from the solver to the vocoder
  - ``warmup``: what each model runs before its first real request
  - ``metrics``: the Prometheus families and what they observe
  - ``reaper``: the idle reaper thread of a stateful model
  - ``draining``: the drain file the python models read
  - ``responses``: the error response every python model sends
  - ``config_params``: reading a served config's parameters, typed
  - ``keys``: the fleet's keys, read from mounted files
  - ``heap``: giving freed heap memory back after a large request
  - ``parent_watch``: a python stub goes when its tritonserver dies (a watch process beside it)

- ``repository/`` (build time, beside ``server``): writing the model repository

  - ``generator``: the repository for a target (cpu or gpu)
  - ``configs``: every ``config.pbtxt`` as a ``ModelConfig`` from the contract
  - ``model_config``: ``ModelConfig`` protobufs written and read
  - ``settings``: what a repository is built for (target, solver settings, batching)
  - ``warmup_samples``: Triton's ``model_warmup`` samples
  - ``backends``: switching a gpu repository's stateless models between TensorRT and torch
  - ``cli``: the command line of ``scripts/build_repository.py``

- ``server/`` (around the server, a process of its own)

  - ``triton_server``: start and stop a real ``tritonserver`` by PID
  - ``install``: where tritonserver is, and a python backend that runs our venv
  - ``processes``: processes and ports by number, never by name
  - ``drain``: the graceful drain supervisor
  - ``access``: restricted API categories behind a key, and gRPC TLS
  - ``leftovers``: what a server leaves in ``/dev/shm``, removed
  - ``metrics_reader``: a server's Prometheus metrics read back

Training (``s3flow_training``, top-level ``training/``) and the measuring tools (``s3flow_tools``, ``tools/``) sit
outside the served package; nothing in it imports them.
"""

"""heterps_ray.runtime: runs a plan as a pipeline of Ray actors (and the one-process reference trainer).

Design (see DESIGN.md §1):

* **Stage 0** (the stage holding layer 0, the embedding layer) runs inside the **DataWorkers**
  (``workers.DataWorker``): its replica count is the number of DataWorkers, on its resource type.
  Stages 1..S-1 are **StageWorker** actors. Every actor is pinned with the type's
  ``actor_options()`` (custom resource ``{type: 1}``, num_cpus, num_gpus), sets
  ``torch.set_num_threads(type.torch_threads)`` and uses ``cuda`` when the type's device is cuda
  and a GPU is visible, else the CPU.
* **No driver in the data path.** Each DataWorker drives its micro-batches through the
  StageWorkers itself, chaining ObjectRefs with plain actor calls (activations inline in the
  call: ``cluster.SYSTEM_CONFIG`` raises Ray's direct-call object size), micro-batch ``c`` of DataWorker
  ``w`` going to replica ``(c + w) % k`` of a stage with ``k`` replicas (M:N round robin) and
  its backward to the same replicas. At most ``runtime.max_in_flight`` micro-batches per
  DataWorker are in flight; calls from one DataWorker run in submission order on each actor.
* **Reader thread** (``reader.py``): the next batches are read, converted and their keys split
  by PS shard while the current one trains.
* **PS hosting**: with one DataWorker and no replicated stage, the PS shards live in the
  DataWorker's process (``runtime.ps_hosting: auto``); pulls and pushes are plain calls then.
* **Modes** (``modes.py``): what sync and async do differently sits in one object per mode, chosen
  once when the run starts (``ActorSet.mode``): the plan's replica rule, where dense weights live,
  the DataWorker's sparse schedule (``sparse.py``: per batch or per micro-batch), the dense fence
  before a snapshot, the resume rule and the accounting. Workers and phases run one path.
* **PS shards for the driver** (``shards.py``): one interface whether a shard is an actor or hosted
  in DataWorker 0 (``RemoteShard``, ``HostedShard``), chosen when the actor set starts.
* **Stage compute** (``stage.py``): what DataWorkers and StageWorkers both do with their layers
  (module, optimizer, backward from wire gradients, weight stashing, state).
* **sync** = numerically the reference trainer (``reference.py``): one replica per stage; a batch
  of B samples is cut into ``runtime.micro_batches`` micro-batches pipelined GPipe-style; each
  micro-batch loss is scaled by mb/B so gradients sum to the full-batch gradient; dense params and
  Adam live in each worker (Adam is elementwise, so splitting parameters across stages
  changes nothing) and step after the batch's last micro-batch went backward; the DataWorker
  accumulates the batch's embedding gradients and pushes them once per batch (Adagrad sees the
  reference's per-batch gradient) before the next batch's pull.
* **async** (Paddle's a_sync style): several DataWorkers and stage replicas with no barrier
  between them; each micro-batch is one update. A stage with one replica keeps its weights
  local; a replicated stage's weights live on a PS shard (push gradients, fresh weights back
  when more than ``runtime.max_staleness`` behind). ``runtime.batches_ahead`` lets a DataWorker
  start batches before its earlier ones are applied. docs/DESIGN.md "Staleness" states the bounds.
* **Driver** (``driver.train`` / ``heterps train``) wires one run's parts in order: the actor set
  (``actors.py``: start, place, replace, rewire), the chunk loop (``loop.py``: chunks of steps,
  progress, tracking, the elastic and floor checks), recovery (``recovery.py``), checkpoints taken
  and restored, also into another plan (``snapshots.py``; the folder format and model files in
  ``checkpoint.py``: .npz, no pickle), then evaluation, accounting and the saved model
  (``finish.py``) and ``run_summary.json``.
* **Faults** (``faults.py``, ``recovery.py``): a dead actor is re-created with the same options, every actor rolls
  back to the newest checkpoint (else the run's start) and the batches since are replayed; calls
  sent before the recovery carry an older generation and are dropped. PS shards count the pushes
  they applied per (DataWorker, batch), so the summary proves no batch was lost or applied twice.
* **Elastic** (``elastic.py``): with ``train(elastic=True)`` (``heterps run``) a change of the
  cluster's resource types stops the run at a checkpoint for a re-plan; a checkpoint loads into any
  plan of the same model in sync mode (dense state by layer name, PS rows re-sharded).
"""

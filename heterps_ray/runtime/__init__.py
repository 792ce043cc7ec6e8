"""heterps_ray.runtime: runs a plan as a pipeline of Ray actors (and the one-process reference trainer).

Design (see DESIGN.md §1):

* **Stage 0** (the stage holding layer 0, the embedding layer) runs inside the **DataWorkers**
  (``workers.DataWorker``): its replica count is the number of DataWorkers, on its resource type.
  Stages 1..S-1 are **StageWorker** actors. Every actor is pinned with the type's
  ``actor_options()`` (custom resource ``{type: 1}``, num_cpus, num_gpus), sets
  ``torch.set_num_threads(type.torch_threads)`` and uses ``cuda`` when the type's device is cuda
  and a GPU is visible, else the CPU.
* **No driver in the data path.** Each DataWorker chains ObjectRefs through the StageWorkers:
  ``r1 = s1.forward(id, x)``, ``r2 = s2.forward(id, r1)``, ..., the last stage computes the loss
  and returns its input's gradient, then ``backward`` calls run in reverse, each taking the next
  stage's gradient ref. Micro-batch ``c`` of DataWorker ``w`` goes to replica ``(c + w) % k`` of
  a stage with ``k`` replicas (M:N round robin) and its backward to the same replicas. At most
  ``runtime.max_in_flight`` micro-batches per DataWorker are in flight (``ray.wait``-style
  backpressure by blocking on the oldest); backward calls trail forward calls by
  ``max_in_flight - 1`` micro-batches (1F1B), so stages have forward work while gradients return.
  Calls from one DataWorker run in submission order on each actor; StageWorkers key saved
  activations by micro-batch id, so several DataWorkers can share a replica.
* **sync** = numerically the reference trainer (``reference.py``): one replica per stage; a batch
  of B samples is cut into ``runtime.micro_batches`` micro-batches pipelined GPipe-style; each
  micro-batch loss is scaled by mb/B so gradients sum to the full-batch gradient; dense params and
  Adam live in each StageWorker (Adam is elementwise, so splitting parameters across stages
  changes nothing) and step after the batch's last micro-batch went backward; the DataWorker
  accumulates the batch's embedding gradients and pushes them once per batch (Adagrad sees the
  reference's per-batch gradient) before the next batch's pull.
* **async** (Paddle's a_sync style): stage replicas; dense params live on a PS shard
  (``ps.shard.PSShard`` dense tables, Adam or SGD); every backward pushes its dense gradients
  there and a replica pulls fresh weights when the newest version it knows is more than
  ``runtime.max_staleness`` ahead of its own; DataWorkers pull and push sparse rows per micro-batch
  without a barrier.
* **PS shards** (``ps.shard``): a hash partition of the sparse table, rows created lazily from
  (key, seed) only, so 1, 2 or 4 shards train the same model.
* **Driver** (``driver.train`` / ``heterps train``): starts the actors, drives the DataWorkers in
  chunks of steps, shows progress, evaluates AUC/logloss through the pipeline, and writes
  ``run_summary.json`` and ``model/`` (``checkpoint.py``: .npz, no pickle).
* **Faults** (``faults.py``): a dead actor is re-created with the same options, every actor rolls
  back to the newest checkpoint (else the run's start) and the batches since are replayed; calls
  sent before the recovery carry an older generation and are dropped. PS shards count the pushes
  they applied per (DataWorker, batch), so the summary proves no batch was lost or applied twice.
* **Elastic** (``elastic.py``): with ``train(elastic=True)`` (``heterps run``) a change of the
  cluster's resource types stops the run at a checkpoint for a re-plan; a checkpoint loads into any
  plan of the same model in sync mode (dense state by layer name, PS rows re-sharded).
"""

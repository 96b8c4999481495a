"""Training stage: the EAGLE-3 draft with training-time test, checkpoints, resume, and torchrun DDP.

``python -m pipeline.stages.train --plan PLAN [--input DIR ...] [--out DIR]``

Inputs (found by manifest kind): the extraction (``hidden_states``; offline shards, or in online
mode the tokenized sources the target is run over on the fly) and the draft vocabulary (``vocab``).
Each step takes ``[train] batch_size`` sequences (the global batch), unrolls TTT over ``ttt_steps``
and minimises ``sum_j loss_decay**j * CE_j``, the soft-label cross-entropy between the draft and the
target's distribution over the draft vocabulary, on the positions whose predicted token is an
assistant token (``loss_mask``). ``acc_j`` is the share of those positions where the draft's greedy
token (mapped through d2t) equals the target's greedy token.

fp32 on the CPU, bf16 autocast (fp32 master weights) on a GPU. Every ``checkpoint_every`` steps a
checkpoint ``checkpoints/step_NNNNNNNN/`` (SGLang-loadable ``config.json`` + ``model.safetensors``,
plus ``training_state.pt``) appears atomically; a retry resumes from the newest one and the loss
curve continues from that step. At every checkpoint the draft's accept length is simulated on the
extraction's held-out rows (the draft method's, :mod:`pipeline.drafts`); the finished draft ``draft/`` is the checkpoint where it
was best (or the last step without held-out rows) — pass it to SGLang as ``--speculative-draft-model-path``.

Modules: :mod:`.settings` (the data order and the learning-rate schedule ``[train]`` implies),
:mod:`.batches` (from the store or the target), :mod:`.feeder` (batches assembled ahead on a GPU),
:mod:`.inputs` (the extraction, the vocabulary and the data source over them), :mod:`.checkpoints`,
:mod:`.components` (the trainer's parts: runtime, data source, draft, loss, optimiser, checkpointer, evaluator,
metric reporter — built by keyword), :mod:`.steps` (one step over those parts), :mod:`.loop` (the program:
builds the parts, runs the steps), :mod:`.output` (``draft/`` and the manifest). The draft, its loss, its
acceptance simulation and its export are the draft method's (``[train] draft``, :mod:`pipeline.drafts`).

Several processes: ``[train] nproc = N`` makes the stage re-run itself under ``torchrun`` (gloo on the
CPU, NCCL on GPUs); plain DDP, every rank holds the whole draft; the global batch is split by rank
(``idx[rank::world]``) and the loss is normalised by the *global* count of loss positions, so N
processes compute exactly the update one process computes on the same global batch.
"""

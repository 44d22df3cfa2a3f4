"""Check 5: per-step verification of gradient computation (algorithm-based fault tolerance).

A Linear-like layer (``nn.Linear``; Hugging Face's ``Conv1D``, a Linear with its weight stored transposed)
with input ``X`` (N x in) and output gradient ``dY`` (N x out) computes two gradients in its backward:

* the weight gradient ``dW = dYᵀ X``. For random vectors ``r`` (out) and ``s`` (in),
  ``rᵀ dW s = Σ_n (dY_n · r)(X_n · s)``: two matrix-vector products, computed in module hooks while the
  step runs (``X s`` in the forward hook, ``dY r`` in a hook on the output's gradient), against the
  matrix-matrix product the gradient itself costs. The bias gradient ``db = Σ_n dY_n`` gives
  ``rᵀ db = Σ_n dY_n · r``, and an ``nn.Embedding``'s scatter-add gives ``rᵀ dW s = Σ_n r[idx_n] (dY_n · s)``.
  The expected values accumulate across microbatches (and across the modules that share a tied weight); in
  the DDP communication hook, before the all-reduce, each covered parameter's actual ``rᵀ G s`` must match
  within a rounding bound derived from the data:

      bound = slack · ε · rms(r) rms(s) · [(√K + √in + √out) · ‖a∘b‖₂ + (√in + 1) · ‖G‖_F]

  where ``a_n = ‖X_n‖``, ``b_n = ‖dY_n‖``, ``K`` the rows summed and ``ε`` the unit roundoff of the matmul's
  dtype (bf16 under autocast, TF32 where CUDA matmuls use it). The first term is the statistical rounding of
  the gradient GEMM and of both projections (random signs make their errors add like a random walk: ``‖a∘b‖``
  bounds the size of the summed terms), the second that of ``G s`` and of a low-precision gradient.
* the input gradient ``dX = dY W``, which flows on to every layer below: a wrong value there would reach
  their weight gradients through ``dY`` consistently, so their own checks could not see it. Row by row,
  ``dX_n · s = dY_n · (W s)``: ``dX s`` in a hook on this layer's own share of its input's gradient (a view of
  the input made for the layer alone), ``dY (W s)`` beside ``dY r``, and ``W s`` once per step. Each
  row must match within ``slack · ε · rms(s) · (√out + √in + 2) · ‖W‖_F · ‖dY_n‖``; rows are compared one by
  one, so a wrong element stands out of its own row, not of the sum of all rows.

What a covering module cannot explain is left out, never blamed: at the first step the autograd graph is
walked, and a covered parameter that receives a gradient from more places than its covering modules'
forwards (a weight used outside its module: a head tied with ``F.linear(x, wte.weight)``, attention's
``out_proj`` inside ``F.multi_head_attention_forward``) is left out with one warning that names it. Modules
whose class overrides ``forward`` are not covered (a subclass may compute something else from its weight).
Normalisation layers are checked by ``norms``, attention's forward products by ``products``, forward GEMMs by
``forward``; FSDP2 and tensor parallel's local GEMMs by ``sharded``. The parts: ``checks`` (the hooks and the check),
``layers`` (what is covered, the coverage report), ``sums`` (the arithmetic and bounds), ``verdict`` (every rank's
worst ratio judged), ``flops`` (the backward's FLOPs, for coverage), ``rowstats`` (one read of each tensor a hook
checks for all its products and row norms: a Triton kernel on CUDA), ``productstats`` (one read of each tensor of
attention's batched products for their check: a Triton kernel on CUDA), ``tiles`` (what those kernels share:
Triton imported at the first call on CUDA, the tiles' sizes), ``weights`` (what the checks need of each
weight, once a step, per group of like-shaped layers), ``shared`` (one read of an input several layers take:
attention's q, k and v), ``measured`` (gradients measured where whole, judged once at the step's end over every
bucket), ``dispatch`` (the hooks' timing, and what their dispatch costs the host beyond it, for the budget's
estimate). The hooks record; the checks run batched per step. Not covered:
elementwise layers, convolutions, and any parameter of another module type. Coverage is reported at the first
step as a share of parameters and of backward FLOPs.
"""

from .checks import GradientChecks
from .layers import OUTSIDE, Coverage, layer_kind
from .verdict import check, judge

__all__ = ["OUTSIDE", "Coverage", "GradientChecks", "check", "judge", "layer_kind"]

"""The hand-written kernels, each beside its torch reference and the shapes it serves.

Every module holds one kernel (Triton) or one family: the reference it must equal, a `serves(...)`
saying which shapes it takes, the kernel and its launcher. The model (lopa.model) calls the
dispatching functions; which implementation runs is decided here (lopa.kernels.dispatch): the CPU
always runs the references, a GPU with Triton the kernels (LOPA_KERNELS=torch: the references).

- rms_norm: the residual add and the RMSNorm after it, in one pass over the row;
- rotary: RoPE of the queries and keys out of the q/k/v product, and the window's K/V written to
  their staging in the same pass;
- swiglu: SiLU(gate) x up, read from the fused gate/up output;
- fp8: the FP8 weight format (e4m3, per-output-channel scales) and its reference product;
- fp8_linear: the FP8 weight-only product for at most 256 rows (split-K for narrow outputs);
- fp8_products: the choice per shape among fp8_linear, torch._scaled_mm and the reference;
- vocab_stats: the lm_head and the greedy statistics (token, P, Conf) in one pass over the
  vocabulary;
- dispatch: which implementation runs per device and shape; triton_support: Triton when it is
  installed, and how a kernel is declared with it.

Each kernel is checked against its reference in Triton's interpreter (TRITON_INTERPRET=1, on the
CPU): tests/runtime/kernels, run by tests/runtime/test_kernels_interpreted.py.
"""

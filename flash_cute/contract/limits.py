"""What no pipeline does yet, or does only in some combinations, as data: the README lists it
under the support matrix (`flash_cute.tools.support_matrix`), and every NotImplementedError a
public path raises names one of these terms, a capability or a head dim (a test reads the
messages from the source), so a refusal in the code is a gap the documentation states.

Plain Python (a contract): no torch, no CuTe DSL."""

# (a term each refusal of this kind contains, what is missing).
NOT_BUILT = (
    ("is not built in flash-cute", "MLA's qv operand, gathered K/V (gather_kv_indices and "
                                   "its backward options), FA4's scheduler_metadata, block "
                                   "sparsity with varlen"),
    ("FP8 forward", "FP8 beyond a forward on sm_90a: no backward; on a KV cache, reading "
                    "only (no append, rotary or cache_batch_idx); pages of a power of two "
                    "from 8 rows"),
    ("block scales with softcap", "FP8 block scales with softcap"),
    ("alibi_slopes", "ALiBi with a score_mod, with FA4-form mods, or under torch.compile"),
    ("FA4-form mods", "FA4-form mods under torch.compile"),
    ("cache_batch_idx with a paged cache", "cache_batch_idx with a paged cache"),
    ("page_table", "gradients through the operators' page_table (the public functions "
                   "gather the pages instead)"),
    ("block_table in flash_attn 2", "flash-attn 2's paged varlen form"),
    ("with a block_mask", "deterministic=True with a block mask"),
    ("pack_gqa=True", "pack_gqa=True with dropout, or with a group that does not divide the "
                      "tile"),
    ("packed (varlen) layout", "a packed (varlen) side with a padded one, unless "
                               "cu_seqlens says how"),
    ("partial_out", "float32 partial outputs on a pipeline without split-KV"),
    ("runs on sm_", "a pipeline on other GPUs than its own (the GPUs column)"),
    ("learnable captured tensors", "the gradients of a score mod's learnable captured "
                                   "tensors in the blackwell backward"),
)
# Terms of the matrix itself that a refusal may name instead; "pipelines that support it"
# ends dispatch's capability message, whose subject is a capability's spelled name.
MATRIX_TERMS = ("head dims", "hdim", "compute capability", "shared memory", "no such pipeline",
                "pipelines that support it")

"""The fast backend's step kernels (runtime/engines/fast.py): Triton, and two CUDA C++ GEMVs.

One module per fused step, each with the plain-torch reference it is tested against:

    linear.py     every projection of up to MAX_ROWS rows on the tensor cores: skinny GEMM with the RMSNorm
                  from row sums, residual / SiLU*mul epilogues, split K
    gemv.py       the same for one row on the CUDA cores (decode, single draft steps), RMSNorm prologue
    cuda_gemv.py  the same in CUDA C++ (gemv.cu, built with nvcc as the fast engines load) for the shapes the
                  tile tables list: weight rows streamed into shared memory by cp.async.bulk
    qlinear.py    the same with quantized weights (FP8 blocks, INT4 groups; codes converted in registers,
                  qcodes.py); one row on qgemv.py's Triton GEMV, or (INT4, where nvcc builds it) in
                  CUDA C++ on the tensor cores (qgemv.cu, cuda_qgemv.py)
    tile_finish.py  what linear's and qlinear's tile kernels do after their K loop (row scaling, epilogues,
                  split-K partials) and the row sums that carry an RMSNorm between calls (RowSums)
    rope_kv.py    q/k RMSNorm + RoPE + KV-cache write of one step's new tokens
    attention.py  split-KV attention over the live KV length with the tree mask, and its reduction
                  (its online-softmax steps in attention_steps.py)
    norm.py       the embedding gather (with row sums), the EAGLE3 step's input norms, RMSNorm launches
    config.py     KernelConfig: what is left to a user or a benchmark (PDL, the CUDA GEMV, the tile tables
                  in tiles.json)

The kernels take up to ``MAX_ROWS`` query rows (decode, chain and tree verify, draft steps); a batch step of more
rows in all, each sequence at most MAX_ROWS (prompt chunks beside decoding rows), keeps rope_kv and attention and
takes cuBLAS for its projections (linear.wide_linear); longer passes (prompts) run the reference modules. The tile
kernels reduce each row in an order that does not depend on how many rows the call carries (fixed tiles of 16 rows,
tiles chosen by the weight shape only; attention's several-row layout from 2 rows on, and under
KernelConfig.row_invariant one layout for every row count). One-row calls of the GEMV shapes reduce in another
order, so a token decoded alone and the same token verified in a block may round differently, and in bf16
speculative and plain greedy decoding may part at a near tie (benchmarks/fast_agreement.py counts them).
"""

MAX_ROWS = 64       # query rows per fused call: a 64-node tree or a chain of 63 drafts
ROW_TILE = 16       # rows per tile: the smallest tl.dot M, fixed so results do not depend on the row count

"""How the backward's row kernels (preprocess, postprocess) and the Hopper epilogues' row
copies share a row among threads: integer arithmetic only, the same for the host's launch
shape and the kernels' tiled copies."""

# The threads of a CTA of either kernel, and about how many 128-bit loads each has in flight
# per tensor.
ROW_THREADS = 128
VECTORS_PER_THREAD = 8


def row_split(row_vectors: int, num_threads: int = ROW_THREADS,
              vectors_per_thread: int = VECTORS_PER_THREAD) -> tuple:
    """(threads per row, rows per CTA) for rows of `row_vectors` 128-bit vectors.

    Threads per row: the largest power of two (at most a warp) dividing `row_vectors`, so every
    thread loads the same number of vectors of a row. Rows per thread: enough for about
    `vectors_per_thread` loads in flight per tensor.
    """
    threads_per_row = lanes_per_row(row_vectors)
    rows_per_thread = max(1, vectors_per_thread // (row_vectors // threads_per_row))
    return threads_per_row, num_threads // threads_per_row * rows_per_thread


def lanes_per_row(row_vectors: int) -> int:
    """The largest power of two (at most a warp) that divides a row's `row_vectors` vectors:
    that many consecutive threads share a row, each taking as many of its vectors."""
    return min(row_vectors & -row_vectors, 32)

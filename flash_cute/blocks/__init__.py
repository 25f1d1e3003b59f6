"""Device blocks (CuTe DSL), written once for every arch: the score seam, softmax, mask,
sequence lengths, dropout, software exp2, the LSE merge, the backward's blocks, the mods'
emitters. They import the contracts and the DSL only."""

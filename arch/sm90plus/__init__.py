"""Plumbing every pipeline from sm90 on shares (hopper now, blackwell next): TMA descriptors,
atoms, partitions and the mbarrier pipelines they fill (`tma`), the host-side stride fix a TMA
descriptor needs (`host`), named barriers as an enum per kernel (`barriers`) and paired
fp32-to-16-bit conversions (`convert`). Nothing here issues an MMA."""

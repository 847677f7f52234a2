"""What is held: the fixed slots every layer keeps (`slots`), recall's bounded store of evicted tokens (`store`),
8-bit keys and values (`quant`), when and how big they are allocated (`allocation`), row views, forks and
snapshots of a cache (`rowviews`) and a cache saved to disk and read back (`persist`)."""

"""What is held: the fixed slots every layer keeps (`slots`), recall's bounded store of evicted tokens (`store`,
and its upkeep outside any step: `upkeep`), 8-bit keys and values (`quant`), the object that owns them and
allocates, grows, moves, selects and restores them (`storage`: everything that replaces a buffer), and a cache
saved to disk and read back (`persist`)."""

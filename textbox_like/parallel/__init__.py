"""Device placement and sharding: Accelerate's Accelerator, FSDP2, malloc's settings for them."""

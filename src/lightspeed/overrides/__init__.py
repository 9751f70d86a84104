"""Lightning's `overrides` path: wrappers lightspeed puts around what the user's loaders hand out
(`distributed._IndexBatchSamplerWrapper`)."""

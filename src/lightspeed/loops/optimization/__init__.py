"""Lightning's `loops.optimization` path: `automatic.Closure`."""

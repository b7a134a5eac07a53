"""Vision models through mlx-vlm, on a thread of their own."""

"""Images: the bounded header probe, decoding and resizing (CPU and GPU), the decode byte budget, image types."""

"""Quality and fidelity evaluation of fused prefills."""

"""Measuring and back-of-the-envelope arithmetic: the roofline (notebook 04), this device's roofs (00), KV memory
(03, 06), static-batching arithmetic (05), byte units and honest timers."""

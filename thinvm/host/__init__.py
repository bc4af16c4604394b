"""The host: its memory, pressure, cgroups and huge pages, as VMs and the pool see them."""

"""One virtual machine: its QEMU process, balloon and live migration."""

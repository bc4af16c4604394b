"""thinvm under libvirt: domain XML, the emulator install, a simulated
cluster of libvirt hosts (network namespaces), migration through virsh.

See docs/fleet.md.  Everything here drives Debian's libvirt through
`virsh`: the commands an operator would type, with their errors.
"""

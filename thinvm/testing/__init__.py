"""What the test suite adds to thinvm, and users never run: the guest
profile the suite boots its guests with (profile) and its kept boots
(keptboot).  Nothing outside this package imports it but the one hook of
`thinvm up` (thinvm.vm.registry.vm_class); the thinvm package leaves it
out (packaging/build-debs.sh)."""

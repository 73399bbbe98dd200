//go:build invariants

package segment

// invariants turns on expensive self-checks: the allocator runs Check after
// every change and a double free panics.
const invariants = true

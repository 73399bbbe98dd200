//go:build !invariants

package ioctl

// invariants turns on self-checks: a double Return of a pool lease panics.
const invariants = false

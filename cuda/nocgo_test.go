//go:build !cgo

package cuda_test

// haveCgo: this test binary has the stub, which never loads a library.
const haveCgo = false

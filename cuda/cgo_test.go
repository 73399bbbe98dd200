//go:build cgo

package cuda_test

// haveCgo: this test binary has the real driver bindings, not the stub.
const haveCgo = true

//go:build !cgo

package rdma

import "fmt"

// This file is the verbs provider without cgo: the same API as verbs.go,
// and every call reports ErrUnavailable. Keep the two in step; the tests
// compile against both (CGO_ENABLED=0 go vet ./rdma/).

// errNoCgo is every answer of the provider without cgo.
var errNoCgo = fmt.Errorf("%w: built without cgo", ErrUnavailable)

// noCgoProvider stands in for libibverbs in a build without cgo.
type noCgoProvider struct{}

// Verbs returns a provider that cannot load libibverbs: the package was
// built without cgo.
func Verbs() Provider { return noCgoProvider{} }

// Reason says that the package was built without cgo.
func Reason() string { return "built without cgo" }

// Name returns "libibverbs", the provider this build lacks.
func (noCgoProvider) Name() string { return "libibverbs" }

// Devices returns ErrUnavailable.
func (noCgoProvider) Devices() ([]DeviceInfo, error) { return nil, errNoCgo }

// Open returns ErrUnavailable.
func (noCgoProvider) Open(name string) (Device, error) { return nil, errNoCgo }

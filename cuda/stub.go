//go:build !cgo

package cuda

import (
	"fmt"
	"time"
)

// This file is the package without cgo: the same API, and every entry
// point answers ErrUnavailable. Keep it in step with driver.go and nvml.go;
// the tests compile against both (CGO_ENABLED=0 go vet ./cuda).

var errNoCgo = fmt.Errorf("%w: built without cgo", ErrUnavailable)

// Init reports that CUDA is unavailable: the package was built without cgo.
func Init() error { return errNoCgo }

// Available reports false: the package was built without cgo.
func Available() bool { return false }

// Library returns "": nothing is loaded without cgo.
func Library() string { return "" }

// DriverVersion returns ErrUnavailable.
func DriverVersion() (int, error) { return 0, errNoCgo }

// DeviceCount returns ErrUnavailable.
func DeviceCount() (int, error) { return 0, errNoCgo }

// Devices returns ErrUnavailable.
func Devices() ([]Device, error) { return nil, errNoCgo }

// Discover returns ErrUnavailable.
func Discover() ([]GPU, error) { return nil, errNoCgo }

// Context is a primary-context reference; without cgo none can be made.
type Context struct{ _ struct{} }

// Retain returns ErrUnavailable.
func Retain(ordinal int) (*Context, error) { return nil, errNoCgo }

// Ordinal returns -1.
func (c *Context) Ordinal() int { return -1 }

// Release returns ErrUnavailable.
func (c *Context) Release() error { return errNoCgo }

// MakeCurrent returns ErrUnavailable.
func (c *Context) MakeCurrent() error { return errNoCgo }

// HostRegister returns ErrUnavailable.
func (c *Context) HostRegister(mem []byte, flags HostRegisterFlags) error { return errNoCgo }

// HostUnregister returns ErrUnavailable.
func (c *Context) HostUnregister(mem []byte) error { return errNoCgo }

// MemAlloc returns ErrUnavailable.
func (c *Context) MemAlloc(n uint64) (DevicePtr, error) { return 0, errNoCgo }

// MemFree returns ErrUnavailable.
func (c *Context) MemFree(p DevicePtr) error { return errNoCgo }

// AddressRange returns ErrUnavailable.
func (c *Context) AddressRange(p DevicePtr) (base DevicePtr, size uint64, err error) {
	return 0, 0, errNoCgo
}

// IpcGetHandle returns ErrUnavailable.
func (c *Context) IpcGetHandle(p DevicePtr) ([IpcHandleSize]byte, error) {
	return [IpcHandleSize]byte{}, errNoCgo
}

// IpcOpen returns ErrUnavailable.
func (c *Context) IpcOpen(handle [IpcHandleSize]byte) (DevicePtr, error) { return 0, errNoCgo }

// IpcClose returns ErrUnavailable.
func (c *Context) IpcClose(p DevicePtr) error { return errNoCgo }

// CopyHtoD returns ErrUnavailable.
func (c *Context) CopyHtoD(dst DevicePtr, src []byte) error { return errNoCgo }

// CopyDtoH returns ErrUnavailable.
func (c *Context) CopyDtoH(dst []byte, src DevicePtr) error { return errNoCgo }

// Stream is a CUDA stream; without cgo none can be made.
type Stream struct{ _ struct{} }

// NewStream returns ErrUnavailable.
func (c *Context) NewStream() (*Stream, error) { return nil, errNoCgo }

// Context returns nil.
func (s *Stream) Context() *Context { return nil }

// Sync returns ErrUnavailable.
func (s *Stream) Sync() error { return errNoCgo }

// SyncAfter returns ErrUnavailable.
func (s *Stream) SyncAfter(d time.Duration) error { return errNoCgo }

// Close returns ErrUnavailable.
func (s *Stream) Close() error { return errNoCgo }

// CopyHtoDAsync returns ErrUnavailable.
func CopyHtoDAsync(dst DevicePtr, src []byte, s *Stream) error { return errNoCgo }

// CopyDtoHAsync returns ErrUnavailable.
func CopyDtoHAsync(dst []byte, src DevicePtr, s *Stream) error { return errNoCgo }

// PointerIsDevice returns ErrUnavailable.
func PointerIsDevice(addr uintptr) (bool, error) { return false, errNoCgo }

// ExportDmabuf returns ErrUnavailable.
func (c *Context) ExportDmabuf(p DevicePtr, n uint64) (int, error) { return -1, errNoCgo }

package ioctl

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Linux ioctl number layout (asm-generic/ioctl.h).
const (
	iocNRBits   = 8
	iocTypeBits = 8
	iocSizeBits = 14
	iocNRShift  = 0
	iocTypeSh   = iocNRShift + iocNRBits
	iocSizeSh   = iocTypeSh + iocTypeBits
	iocDirSh    = iocSizeSh + iocSizeBits

	dirNone  = 0
	dirWrite = 1
	dirRead  = 2

	// MaxArgSize is the largest argument a restricted ioctl can carry.
	MaxArgSize = 1<<iocSizeBits - 1
)

// Type is the ioctl type byte of every mooncake-fs command.
const Type = 'M'

// MagicValue is returned by GET_MAGIC: "MOONCAKE" read as little-endian.
const MagicValue uint64 = 0x454b41434e4f4f4d

// ABI version of this package. Minor bumps add commands or flags; major
// bumps change existing structs.
const (
	ABIMajor = 1
	ABIMinor = 9
)

func ioc(dir, nr, size uint32) uint32 {
	return dir<<iocDirSh | size<<iocSizeSh | Type<<iocTypeSh | nr<<iocNRShift
}

// Command numbers.
var (
	CmdGetMagic      = ioc(dirRead, 0x01, SizeMagicArg)
	CmdGetABIVersion = ioc(dirRead, 0x02, SizeABIVersionArg)
)

// Decode helpers split a command number into its fields.

// Dir returns the direction bits of cmd (1 write, 2 read, 3 both).
func Dir(cmd uint32) uint32 { return cmd >> iocDirSh }

// Size returns the argument size encoded in cmd.
func Size(cmd uint32) uint32 { return cmd >> iocSizeSh & (1<<iocSizeBits - 1) }

// TypeOf returns the type byte of cmd.
func TypeOf(cmd uint32) uint32 { return cmd >> iocTypeSh & 0xff }

// Errors of argument decoding.
var (
	ErrShortArg  = errors.New("ioctl: argument too short")
	ErrArgSize   = errors.New("ioctl: argument size field mismatch")
	ErrFlags     = errors.New("ioctl: unknown flags")
	ErrBatchFull = errors.New("ioctl: batch full")
)

// Header is the leading word of every argument struct.
type Header struct {
	Size  uint32 // size of the struct as the caller built it
	Flags uint32
}

func putHeader(b []byte, h Header) {
	binary.LittleEndian.PutUint32(b[0:], h.Size)
	binary.LittleEndian.PutUint32(b[4:], h.Flags)
}

func getHeader(b []byte, want uint32) (Header, error) {
	if len(b) < int(want) {
		return Header{}, fmt.Errorf("%d B, want %d: %w", len(b), want, ErrShortArg)
	}
	h := Header{Size: binary.LittleEndian.Uint32(b[0:]), Flags: binary.LittleEndian.Uint32(b[4:])}
	if h.Size != want {
		return h, fmt.Errorf("size field %d, want %d: %w", h.Size, want, ErrArgSize)
	}
	return h, nil
}

// MagicArg is the argument of GET_MAGIC.
type MagicArg struct {
	Header
	Magic uint64
}

// SizeMagicArg is the wire size of MagicArg.
const SizeMagicArg = 16

// Marshal writes a into a new SizeMagicArg-byte buffer.
func (a MagicArg) Marshal() []byte {
	b := make([]byte, SizeMagicArg)
	putHeader(b, Header{Size: SizeMagicArg, Flags: a.Flags})
	binary.LittleEndian.PutUint64(b[8:], a.Magic)
	return b
}

// Unmarshal reads a from b.
func (a *MagicArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeMagicArg)
	if err != nil {
		return err
	}
	*a = MagicArg{Header: h, Magic: binary.LittleEndian.Uint64(b[8:])}
	return nil
}

// ABIVersionArg is the argument of GET_ABI_VERSION.
type ABIVersionArg struct {
	Header
	Major, Minor uint32
}

// SizeABIVersionArg is the wire size of ABIVersionArg.
const SizeABIVersionArg = 16

// Marshal writes a into a new buffer.
func (a ABIVersionArg) Marshal() []byte {
	b := make([]byte, SizeABIVersionArg)
	putHeader(b, Header{Size: SizeABIVersionArg, Flags: a.Flags})
	binary.LittleEndian.PutUint32(b[8:], a.Major)
	binary.LittleEndian.PutUint32(b[12:], a.Minor)
	return b
}

// Unmarshal reads a from b.
func (a *ABIVersionArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeABIVersionArg)
	if err != nil {
		return err
	}
	*a = ABIVersionArg{Header: h, Major: binary.LittleEndian.Uint32(b[8:]), Minor: binary.LittleEndian.Uint32(b[12:])}
	return nil
}

package cuda

import (
	"errors"
	"fmt"
	"testing"
)

func TestFormatUUID(t *testing.T) {
	b := [16]byte{0xde, 0xad, 0xbe, 0xef, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0xfc}
	if got, want := formatUUID(b), "GPU-deadbeef-0102-0304-0506-0708090a0bfc"; got != want {
		t.Errorf("formatUUID = %q, want %q", got, want)
	}
}

func TestNormalizeBusID(t *testing.T) {
	for in, want := range map[string]string{
		"0000:1B:00.0":     "0000:1b:00.0", // cuDeviceGetPCIBusId
		"00000000:1B:00.0": "0000:1b:00.0", // NVML
		"00010000:1b:00.0": "00010000:1b:00.0",
		"0001:1b:00.0":     "0001:1b:00.0",
		"garbage":          "garbage",
	} {
		if got := normalizeBusID(in); got != want {
			t.Errorf("normalizeBusID(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestResult(t *testing.T) {
	r := &Result{Func: "cuMemAlloc_v2", Code: ResultOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY", Message: "out of memory"}
	err := fmt.Errorf("cuda: alloc 1 B: %w", r)
	if !errors.Is(err, ErrDriver) || !errors.Is(err, ErrOutOfMemory) || errors.Is(err, ErrUnavailable) {
		t.Errorf("%v matches the wrong sentinels", err)
	}
	if got, want := err.Error(), "cuda: alloc 1 B: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	bare := &Result{Func: "cuInit", Code: 100}
	if errors.Is(bare, ErrOutOfMemory) || bare.Error() != "cuInit: CUresult 100" {
		t.Errorf("bare result: %v", bare)
	}
}

package tests

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/cuda"
)

// TestGPU runs the GPU checks (tests/internal/gpucheck) against a real
// daemon: PUT_CUDA/GET_CUDA at offsets, partial and short gets, refusals
// that change nothing, CUDA registrations, a child that exits with its
// handle open. It skips where CUDA is unavailable (CI); on the GPU host
// tests/gpu/check.sh runs the same program with carried binaries.
func TestGPU(t *testing.T) {
	if err := cuda.Init(); err != nil {
		t.Skipf("no GPU: %v", err)
	}
	d := startDaemon(t, "--size", "1GiB")
	bin := filepath.Join(t.TempDir(), "gpucheck")
	build := exec.Command("go", "build", "-o", bin, "./internal/gpucheck")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build gpucheck: %v\n%s", err, out)
	}
	dir := d.path("gpu")
	run(t, "mkdir", dir)
	out, err := exec.Command(bin, dir).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "PASS") {
		t.Fatalf("gpucheck: %v\n%s", err, out)
	}
	t.Log(string(out))
}

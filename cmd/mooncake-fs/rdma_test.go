package main

import (
	"errors"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/rdma"
	"github.com/mooncake-fs/mooncake-fs/rdma/rdmafake"
)

func TestOpenRDMA(t *testing.T) {
	p, err := rdmafake.New(rdmafake.Options{Dir: t.TempDir(), Devices: []string{"f0", "f1", "f2"}})
	if err != nil {
		t.Fatal(err)
	}
	names := func(devs []rdma.Device) []string {
		var out []string
		for _, d := range devs {
			out = append(out, d.Info().Name)
			d.Close()
		}
		return out
	}
	devs, def, err := openRDMA(p, nil, -1)
	if got := names(devs); err != nil || len(got) != 3 || got[0] != "f0" || got[2] != "f2" || def != 0 {
		t.Fatalf("all devices: %v (default %d) %v", got, def, err)
	}
	devs, def, err = openRDMA(p, []string{"f2", "nope", "f1"}, -1)
	if got := names(devs); err != nil || len(got) != 2 || got[0] != "f2" || got[1] != "f1" || def != 0 {
		t.Fatalf("named devices: %v (default %d) %v (want the flag's order)", got, def, err)
	}
	if _, _, err := openRDMA(p, []string{"nope"}, -1); !errors.Is(err, rdma.ErrUnavailable) {
		t.Fatalf("only a missing device named: %v", err)
	}
}

func TestPCIHelpers(t *testing.T) {
	for in, want := range map[string]string{
		"00000000:3B:00.0": "0000:3b:00.0",
		"0000:3b:00.0":     "0000:3b:00.0",
		"0001:c1:00.1":     "0001:c1:00.1",
	} {
		if got := normalizeBDF(in); got != want {
			t.Errorf("normalizeBDF(%q) = %q, want %q", in, got, want)
		}
	}
	a := []string{"pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"}
	b := []string{"pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:03:00.0"}
	c := []string{"pci0000:80", "0000:80:01.0"}
	if commonPrefix(a, b) != 3 || commonPrefix(a, c) != 0 || commonPrefix(nil, a) != 0 {
		t.Fatal("commonPrefix")
	}
	if nearGPU(nil, nil) != nil {
		t.Fatal("nearGPU without devices")
	}
}

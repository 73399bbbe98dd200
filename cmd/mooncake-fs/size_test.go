package main

import "testing"

func TestParseSize(t *testing.T) {
	for _, c := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"4096", 4096, true},
		{"4GiB", 4 << 30, true},
		{"512MiB", 512 << 20, true},
		{"1.5G", 3 << 29, true},
		{"2 MiB", 2 << 20, true},
		{"10KB", 10000, true},
		{"", 0, false},
		{"GiB", 0, false},
		{"-1GiB", 0, false},
		{"abc", 0, false},
		{"99999999999999999999TiB", 0, false},
	} {
		got, err := parseSize(c.in)
		if (err == nil) != c.ok || (c.ok && got != c.want) {
			t.Errorf("parseSize(%q) = %d, %v; want %d ok=%v", c.in, got, err, c.want, c.ok)
		}
	}
}

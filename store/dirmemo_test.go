package store

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestDirMemo runs random puts, gets and forgets against a plain map.
func TestDirMemo(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for round := range 200 {
		var m DirMemo[int]
		model := map[string]int{}
		for step := range 50 {
			dir := fmt.Sprintf("d%d", r.IntN(4))
			switch r.IntN(3) {
			case 0:
				m.Put(dir, step)
				model[dir] = step
			case 1:
				m.Forget(dir)
				delete(model, dir)
			}
			for i := range 4 {
				d := fmt.Sprintf("d%d", i)
				got, ok := m.Get(d)
				want, wok := model[d]
				if ok != wok || got != want {
					t.Fatalf("round %d step %d: get(%s) = %d, %v; want %d, %v", round, step, d, got, ok, want, wok)
				}
			}
			if m.has && m.more != nil {
				if _, dup := m.more[m.key]; dup {
					t.Fatalf("round %d step %d: %s both inline and in the map", round, step, m.key)
				}
			}
		}
	}
	var one DirMemo[int]
	one.Put("a", 1)
	if one.more != nil {
		t.Fatal("one directory made a map")
	}
}

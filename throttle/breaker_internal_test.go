package throttle

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// slowObserver records breaker changes after a delay on openings, as a
// slow metrics backend might: without ordering, a closing told meanwhile
// would land first and the last word would be "open" for a closed breaker.
type slowObserver struct {
	nopObserver
	entered chan struct{} // closed when the first opening is being told

	mu     sync.Mutex // guards node and engine
	node   []bool
	engine []bool
}

func (o *slowObserver) ObserveNodeBreaker(_ string, open bool) {
	if open {
		close(o.entered)
		time.Sleep(30 * time.Millisecond)
	}
	o.mu.Lock()
	o.node = append(o.node, open)
	o.mu.Unlock()
}

func (o *slowObserver) ObserveBreaker(open bool) {
	o.mu.Lock()
	o.engine = append(o.engine, open)
	o.mu.Unlock()
}

// TestBreakerChangesInOrder: a success that closes the breaker while its
// opening is still being told to a slow observer is told after it, so the
// observer's last word is the breaker's state.
func TestBreakerChangesInOrder(t *testing.T) {
	o := &slowObserver{entered: make(chan struct{})}
	bs := newBreakers()
	bs.obs, bs.nodeObs = o, o
	done := make(chan struct{})
	go func() {
		defer close(done)
		bs.failure("n", time.Now())
	}()
	<-o.entered // the breaker is open and the opening is being told
	bs.success("n")
	<-done
	open, _ := bs.stateOf("n")
	require.False(t, open)
	o.mu.Lock()
	defer o.mu.Unlock()
	require.Equal(t, []bool{true, false}, o.node, "node changes in the order they happened")
	require.Equal(t, []bool{true, false}, o.engine, "engine changes in the order they happened")
}

package metrics_test

import (
	"context"
	"fmt"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/metrics"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

func Example() {
	mr, err := miniredis.Run() // any Redis will do; this one is embedded
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()

	m := metrics.New()
	reg := prometheus.NewRegistry() // or prometheus.DefaultRegisterer: your choice
	reg.MustRegister(m)
	eng, _ := throttle.New(rdb, throttle.WithObserver(m))
	lim, _ := reserve.New(eng, "partner", throttle.PerSecond(10, 1))
	for i := 0; i < 3; i++ {
		_, _ = lim.Allow(context.Background(), "eu")
	}

	families, _ := reg.Gather()
	for _, f := range families {
		if f.GetName() == "slotbook_decisions_total" {
			for _, s := range f.GetMetric() {
				fmt.Println(s.GetLabel()[0].GetValue(), s.GetLabel()[1].GetValue(), s.GetCounter().GetValue())
			}
		}
	}
	// Output:
	// partner allowed 2
	// partner denied 1
}

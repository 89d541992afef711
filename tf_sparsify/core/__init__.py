"""The core every front end shares: options, the plan of units and buckets, the routes a unit
travels by, the pipeline that drives them, the state core and its checkpoint entry."""
